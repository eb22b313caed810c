"""The GPU catalogue (``sluice.operator.gpus``) against NVIDIA's documented facts.

Sources: the MIG user guide ("Supported MIG Profiles": instances per GPU and placements, per GPU),
mig-parted's example config (``all-balanced`` per GPU), the device plugin's resource names
(``nvidia.com/mig-<profile>``, ``+me`` as ``.me``) and GPU feature discovery's ``nvidia.com/gpu.product``
values (``-MIG-<profile>`` under the single strategy, ``-SHARED`` under time-slicing).
"""

from __future__ import annotations

import pytest

from sluice.operator import gpus

A100_40 = gpus.CATALOGUE_BY_KEY["A100-40GB"]
A100_80 = gpus.CATALOGUE_BY_KEY["A100-80GB"]
A30 = gpus.CATALOGUE_BY_KEY["A30"]


def _model(key: str) -> gpus.GpuModel:
    return gpus.CATALOGUE_BY_KEY[key]


@pytest.mark.parametrize(
    ("key", "profile", "instances"),
    [
        # MIG user guide, "A100 MIG Profiles" (A100-SXM4-40GB): "Number of Instances Available".
        ("A100-40GB", "1g.5gb", 7),
        ("A100-40GB", "1g.5gb+me", 1),
        ("A100-40GB", "1g.10gb", 4),
        ("A100-40GB", "2g.10gb", 3),
        ("A100-40GB", "3g.20gb", 2),
        ("A100-40GB", "4g.20gb", 1),
        ("A100-40GB", "7g.40gb", 1),
        # A100-80GB and H100-80GB share the geometry with twice the memory per slice.
        ("A100-80GB", "1g.10gb", 7),
        ("A100-80GB", "1g.20gb", 4),
        ("A100-80GB", "2g.20gb", 3),
        ("A100-80GB", "3g.40gb", 2),
        ("A100-80GB", "4g.40gb", 1),
        ("A100-80GB", "7g.80gb", 1),
        ("H100-80GB", "1g.10gb", 7),
        ("H100-80GB", "1g.10gb+me", 1),
        ("H100-80GB", "3g.40gb", 2),
        ("H100-94GB", "1g.12gb", 7),
        ("H100-94GB", "3g.47gb", 2),
        ("H200-141GB", "1g.18gb", 7),
        ("H200-141GB", "1g.35gb", 4),
        ("H200-141GB", "2g.35gb", 3),
        ("H200-141GB", "7g.141gb", 1),
        ("B200-180GB", "1g.23gb", 7),
        ("B200-180GB", "3g.90gb", 2),
        # "A30 MIG Profiles".
        ("A30", "1g.6gb", 4),
        ("A30", "1g.6gb+me", 1),
        ("A30", "2g.12gb", 2),
        ("A30", "2g.12gb+me", 1),
        ("A30", "4g.24gb", 1),
        # Not a profile of that GPU.
        ("A30", "1g.5gb", 0),
        ("A100-40GB", "1g.10gb+me", 0),
    ],
)
def test_max_instances_per_profile_match_the_mig_user_guide(key, profile, instances):
    assert gpus.max_instances(_model(key), profile) == instances


@pytest.mark.parametrize(
    ("key", "profiles"),
    [
        ("A100-40GB", ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")),
        ("A100-80GB", ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")),
        ("H100-94GB", ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb")),
        ("H200-141GB", ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb")),
        ("B200-180GB", ("1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb")),
        ("A30", ("1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb")),
    ],
)
def test_each_gpu_lists_exactly_the_profiles_of_its_mig_table(key, profiles):
    assert {p.name for p in _model(key).profiles} == set(profiles)


@pytest.mark.parametrize(
    ("key", "layout"),
    [
        # mig-parted's all-balanced, one entry per GPU.
        ("A100-40GB", (("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3), ("3g.20gb", 4))),
        ("A100-80GB", (("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4))),
        ("H100-80GB", (("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4))),
        ("H100-94GB", (("2g.24gb", 0), ("1g.12gb", 2), ("1g.12gb", 3), ("3g.47gb", 4))),
        ("H200-141GB", (("2g.35gb", 0), ("1g.18gb", 2), ("1g.18gb", 3), ("3g.71gb", 4))),
        ("B200-180GB", (("2g.45gb", 0), ("1g.23gb", 2), ("1g.23gb", 3), ("3g.90gb", 4))),
        ("A30", (("1g.6gb", 0), ("1g.6gb", 1), ("2g.12gb", 2))),
        # Other partitions NVIDIA's A100 diagram shows.
        ("A100-40GB", (("4g.20gb", 0), ("3g.20gb", 4))),
        ("A100-40GB", (("3g.20gb", 0), ("3g.20gb", 4))),
        ("A100-40GB", tuple(("1g.5gb", s) for s in range(7))),
        ("A100-40GB", (("1g.5gb+me", 0), *(("1g.5gb", s) for s in range(1, 7)))),
        ("A100-40GB", (("1g.10gb", 0), ("1g.10gb", 2), ("1g.10gb", 4), ("1g.10gb", 6))),
        ("A100-40GB", (("7g.40gb", 0),)),
        ("A30", (("4g.24gb", 0),)),
        ("A30", (("2g.12gb+me", 0), ("2g.12gb", 2))),
        ("A100-40GB", ()),
    ],
)
def test_documented_layouts_are_valid(key, layout):
    model = _model(key)
    assert gpus.valid_layout(model, layout)
    # pack finds a partition for the same instances.
    packed = gpus.pack(model, [name for name, _ in layout])
    assert packed is not None and gpus.valid_layout(model, packed)
    assert sorted(name for name, _ in packed) == sorted(name for name, _ in layout)


@pytest.mark.parametrize(
    ("key", "layout", "why"),
    [
        ("A100-40GB", (("4g.20gb", 0), ("4g.20gb", 4)), "4g starts only at 0"),
        ("A100-40GB", (("4g.20gb", 0), ("4g.20gb", 0)), "two instances on the same slices"),
        ("A100-40GB", (("1g.5gb+me", 0), ("1g.5gb+me", 1)), "one instance per GPU owns the media engines"),
        ("A30", (("1g.6gb+me", 0), ("2g.12gb+me", 2)), "one instance per GPU owns the media engines"),
        ("A100-40GB", (("7g.40gb", 0), ("1g.5gb", 6)), "7g holds every slice"),
        ("A100-80GB", (("7g.80gb", 0), ("1g.10gb", 0)), "7g holds every slice"),
        ("A100-40GB", (("3g.20gb", 2),), "3g starts at 0 or 4"),
        ("A100-40GB", (("2g.10gb", 1),), "2g starts at 0, 2 or 4"),
        ("A100-40GB", (("2g.10gb", 6),), "2g starts at 0, 2 or 4"),
        ("A100-40GB", (("1g.10gb", 1),), "1g.10gb starts at 0, 2, 4 or 6"),
        ("A100-40GB", (("1g.5gb", 7),), "slice 7 has no compute slice of its own"),
        ("A30", (("2g.12gb", 1),), "2g starts at 0 or 2 on the A30"),
        ("A30", (("4g.24gb", 0), ("1g.6gb", 3)), "4g holds all four slices of the A30"),
        ("A100-40GB", (("3g.20gb", 0), ("3g.20gb", 4), ("1g.5gb", 3)), "more than eight memory slices"),
        ("A100-40GB", (("4g.20gb", 0), ("2g.10gb", 4), ("2g.10gb", 6)), "2g starts at 0, 2 or 4"),
        ("A100-40GB", (("4g.20gb", 0), ("2g.10gb", 4), ("1g.5gb", 6), ("1g.5gb", 7)), "no slice 7 placement"),
        ("A100-40GB", (("1g.6gb", 0),), "an A30 profile on an A100"),
        ("A30", (("1g.5gb", 0),), "an A100 profile on an A30"),
    ],
)
def test_invalid_layouts_are_rejected(key, layout, why):
    assert not gpus.valid_layout(_model(key), layout), why


@pytest.mark.parametrize(
    ("key", "wanted"),
    [
        ("A100-40GB", ["4g.20gb", "4g.20gb"]),
        ("A100-40GB", ["1g.5gb+me", "1g.5gb+me"]),
        ("A100-40GB", ["7g.40gb", "1g.5gb"]),
        ("A100-40GB", ["1g.5gb"] * 8),
        ("A100-40GB", ["3g.20gb", "3g.20gb", "1g.5gb"]),
        ("A30", ["2g.12gb", "2g.12gb", "1g.6gb"]),
        ("A30", ["1g.5gb"]),
    ],
)
def test_pack_refuses_what_no_partition_holds(key, wanted):
    assert gpus.pack(_model(key), wanted) is None


def test_pack_keeps_fixed_instances_where_they_are():
    packed = gpus.pack(A100_40, ["2g.10gb", "1g.5gb", "1g.5gb"], (("3g.20gb", 4),))
    assert packed == (("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3), ("3g.20gb", 4))
    # A 3g at slice 0 leaves memory slices 4-7 but only compute slices 4-6: the same instances no longer fit.
    assert gpus.pack(A100_40, ["2g.10gb", "1g.5gb", "1g.5gb"], (("3g.20gb", 0),)) is None
    assert gpus.pack(A100_40, ["2g.10gb", "1g.5gb"], (("3g.20gb", 0),)) is not None
    assert gpus.pack(A100_40, ["4g.20gb"], (("3g.20gb", 0),)) is None  # 4g only starts at 0
    assert gpus.pack(A100_40, ["1g.5gb"], (("4g.20gb", 4),)) is None  # a fixed layout that is not valid


@pytest.mark.parametrize("model", [m for m in gpus.CATALOGUE if m.mig_capable], ids=lambda m: m.key)
def test_every_profile_starts_and_ends_inside_the_gpu(model):
    assert (model.memory_slices, model.compute_slices) == ((4, 4) if model.key == "A30" else (8, 7))
    for profile in model.profiles:
        assert profile.starts, profile.name
        assert gpus.max_instances(model, profile.name) >= 1
        for start in profile.starts:
            assert gpus.valid_layout(model, ((profile.name, start),)), (profile.name, start)
        assert profile.memory_mib <= model.memory_mib


@pytest.mark.parametrize(
    ("profile", "resource"),
    [
        ("1g.10gb", "nvidia.com/mig-1g.10gb"),
        ("1g.10gb+me", "nvidia.com/mig-1g.10gb.me"),
        ("1g.5gb+me", "nvidia.com/mig-1g.5gb.me"),
        ("7g.141gb", "nvidia.com/mig-7g.141gb"),
        ("2g.12gb+me", "nvidia.com/mig-2g.12gb.me"),
    ],
)
def test_resource_names_round_trip(profile, resource):
    assert gpus.resource_name(profile) == resource
    assert gpus.profile_of_resource(resource) == profile


@pytest.mark.parametrize(
    "resource",
    [
        "nvidia.com/gpu",
        "nvidia.com/gpu.shared",
        "nvidia.com/mig-1g.10gb.memory",  # a GFD label name, not a resource
        "nvidia.com/mig-foo",
        "nvidia.com/mig-8g.80gb",
        "amd.com/gpu",
        "cpu",
        "",
    ],
)
def test_profile_of_non_mig_resources_is_none(resource):
    assert gpus.profile_of_resource(resource) is None


def test_label_names_write_media_extensions_with_a_dot():
    assert gpus.label_name("1g.10gb+me") == "1g.10gb.me"
    assert gpus.label_name("3g.40gb") == "3g.40gb"


@pytest.mark.parametrize(
    ("product", "key", "single"),
    [
        ("NVIDIA-A100-SXM4-80GB", "A100-80GB", None),
        ("NVIDIA-A100-SXM4-40GB", "A100-40GB", None),
        ("NVIDIA-A100-PCIE-40GB", "A100-40GB", None),
        ("NVIDIA-A100-80GB-PCIe", "A100-80GB", None),
        ("NVIDIA-H100-80GB-HBM3", "H100-80GB", None),
        ("NVIDIA-H100-PCIe", "H100-80GB", None),
        ("NVIDIA-H100-NVL", "H100-94GB", None),
        ("NVIDIA-H200", "H200-141GB", None),
        ("NVIDIA-B200", "B200-180GB", None),
        ("NVIDIA-A30", "A30", None),
        ("NVIDIA-GH200-480GB", "H100-96GB", None),
        ("NVIDIA-L4", "L4", None),
        ("NVIDIA-L40S", "L40S", None),
        ("Tesla-T4", "T4", None),
        ("Tesla-T4-SHARED", "T4", None),
        ("NVIDIA-A10G", "A10G", None),
        # Single strategy: GFD appends the MIG profile (and -SHARED when the slices are time-sliced).
        ("NVIDIA-A100-80GB-PCIe-MIG-1g.10gb", "A100-80GB", "1g.10gb"),
        ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "A100-40GB", "1g.5gb"),
        ("NVIDIA-A100-SXM4-40GB-MIG-3g.20gb-SHARED", "A100-40GB", "3g.20gb"),
        ("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb.me", "H100-80GB", "1g.10gb+me"),
        ("NVIDIA-A30-MIG-2g.12gb", "A30", "2g.12gb"),
        ("NVIDIA-A100-SXM4-40GB-MIG-INVALID", "A100-40GB", None),
    ],
)
def test_gpu_feature_discovery_products_map_to_the_catalogue(product, key, single):
    model = gpus.model_for_product(product)
    assert model is not None and model.key == key
    assert gpus.single_profile(product) == single


@pytest.mark.parametrize("product", ["NVIDIA-GB200", "NVIDIA-RTX-PRO-6000", "AMD-Instinct-MI300X", ""])
def test_products_the_catalogue_does_not_list_map_to_none(product):
    assert gpus.model_for_product(product) is None


@pytest.mark.parametrize(
    ("product", "base"),
    [
        ("NVIDIA-A100-80GB-PCIe-MIG-1g.10gb", "NVIDIA-A100-80GB-PCIe"),
        ("NVIDIA-A100-SXM4-40GB-MIG-INVALID", "NVIDIA-A100-SXM4-40GB"),
        ("Tesla-T4-SHARED", "Tesla-T4"),
        ("NVIDIA-A100-SXM4-40GB-MIG-3g.20gb-SHARED", "NVIDIA-A100-SXM4-40GB"),
        ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-80GB-HBM3"),
    ],
)
def test_base_product_strips_what_the_device_plugin_appends(product, base):
    assert gpus.base_product(product) == base


def test_profiles_order_smallest_memory_first_media_last():
    assert gpus.known_profiles([A30]) == ("1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb")
    assert gpus.known_profiles([A100_80])[:3] == ("1g.10gb", "1g.10gb+me", "1g.20gb")
    assert {m.key for m in gpus.models_with("1g.10gb")} == {"A100-40GB", "A100-80GB", "H100-80GB"}


def test_used_slices_counts_compute_and_memory():
    balanced = (("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4))
    assert gpus.used_slices(A100_80, balanced) == (7, 8)
    assert gpus.used_slices(A30, (("2g.12gb", 0),)) == (2, 2)
