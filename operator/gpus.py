"""The GPU catalogue: NVIDIA's MIG geometries per GPU, and the names the device plugin and GFD publish.

Pure data and functions, no I/O. Called by ``api`` (is a MIG profile real anywhere?), ``inventory``
(which GPU is this node's product label?) and ``placement`` (which slices fit, which layouts are valid).

A MIG-capable GPU has ``memory_slices`` memory slices (8; 4 on the A30) and ``compute_slices`` compute
slices (7; 4 on the A30). A GPU instance of profile ``<g>g.<n>gb`` placed at start slice ``s`` holds
memory slices ``[s, s + memory)`` and compute slices ``[s, s + g)``; two instances on one GPU may not
share a slice, each profile may only start where NVIDIA's placement table allows, and at most one
instance per GPU may own the media engines (``+me``). The tables follow NVIDIA's MIG user guide
("Supported MIG Profiles", per GPU); ``memory_mib`` is nominal (the profile name's GB as GiB x 0.95, which
is what GPU feature discovery reports for the A100's profiles) and a node's own
``nvidia.com/mig-<profile>.memory`` label wins where it exists.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Sequence

MIG_PREFIX = "nvidia.com/mig-"
GPU_RESOURCE = "nvidia.com/gpu"
SHARED_GPU_RESOURCE = "nvidia.com/gpu.shared"
"""What a time-sliced GPU is advertised as when the device plugin's ``renameByDefault`` is on."""
SHARED_SUFFIX = ".shared"
"""What ``renameByDefault`` appends to a time-sliced resource's name (``nvidia.com/mig-1g.10gb.shared``)."""
PROFILE_PATTERN = re.compile(r"^(?P<g>[1-7])g\.(?P<gb>[0-9]+)gb(?P<me>\+me)?$")


@dataclasses.dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of one GPU model."""

    name: str
    """As NVIDIA names it: ``1g.10gb``, ``1g.10gb+me``."""
    compute: int
    """Compute slices (the ``g``)."""
    memory: int
    """Memory slices it holds."""
    starts: tuple[int, ...]
    """Memory-slice indices where an instance may start (NVIDIA's placement table)."""
    memory_mib: int
    """Nominal memory in MiB."""

    @property
    def media(self) -> bool:
        """Whether it owns the GPU's media engines (at most one such instance per GPU)."""
        return self.name.endswith("+me")

    @property
    def resource(self) -> str:
        """The extended resource the device plugin advertises it as (mixed strategy)."""
        return resource_name(self.name)


@dataclasses.dataclass(frozen=True)
class GpuModel:
    """One GPU as GPU feature discovery names it, with its MIG geometry (none when not MIG-capable)."""

    key: str
    """Sluice's short name: ``A100-80GB``."""
    product_pattern: str
    """A regular expression matching the ``nvidia.com/gpu.product`` values of this GPU."""
    memory_mib: int
    memory_slices: int = 8
    compute_slices: int = 7
    profiles: tuple[MigProfile, ...] = ()

    @property
    def mig_capable(self) -> bool:
        return bool(self.profiles)

    def profile(self, name: str) -> MigProfile | None:
        return self._by_name.get(name)

    def __hash__(self) -> int:  # the key names one entry; hashing every profile made cached lookups slow
        return hash(self.key)

    @functools.cached_property
    def _by_name(self) -> dict[str, MigProfile]:
        return {p.name: p for p in self.profiles}


def _gib(gb: int) -> int:
    return round(gb * 1024 * 0.95)


def _seven_way(small: int, double: int, half: int, full: int, *, whole_mib: int) -> tuple[MigProfile, ...]:
    """The geometry A100, H100, H200 and B200 share: 8 memory slices, 7 compute slices.

    ``small`` is the 1g profile's GB, ``double`` the 1g/2g profiles holding two memory slices,
    ``half`` the 3g/4g profiles holding four, ``full`` the 7g profile."""
    return (
        MigProfile(f"1g.{small}gb", 1, 1, (0, 1, 2, 3, 4, 5, 6), _gib(small)),
        MigProfile(f"1g.{small}gb+me", 1, 1, (0, 1, 2, 3, 4, 5, 6), _gib(small)),
        MigProfile(f"1g.{double}gb", 1, 2, (0, 2, 4, 6), _gib(double)),
        MigProfile(f"2g.{double}gb", 2, 2, (0, 2, 4), _gib(double)),
        MigProfile(f"3g.{half}gb", 3, 4, (0, 4), _gib(half)),
        MigProfile(f"4g.{half}gb", 4, 4, (0,), _gib(half)),
        MigProfile(f"7g.{full}gb", 7, 8, (0,), min(_gib(full), whole_mib)),
    )


def _a30() -> tuple[MigProfile, ...]:
    return (
        MigProfile("1g.6gb", 1, 1, (0, 1, 2, 3), _gib(6)),
        MigProfile("1g.6gb+me", 1, 1, (0, 1, 2, 3), _gib(6)),
        MigProfile("2g.12gb", 2, 2, (0, 2), _gib(12)),
        MigProfile("2g.12gb+me", 2, 2, (0, 2), _gib(12)),
        MigProfile("4g.24gb", 4, 4, (0,), _gib(24)),
    )


CATALOGUE: tuple[GpuModel, ...] = (
    GpuModel("A30", r"A30\b", 24576, 4, 4, _a30()),
    GpuModel("A100-40GB", r"A100.*40GB", 40960, profiles=_seven_way(5, 10, 20, 40, whole_mib=40960)),
    GpuModel("A100-80GB", r"A100.*80GB", 81920, profiles=_seven_way(10, 20, 40, 80, whole_mib=81920)),
    GpuModel("GH200-144GB", r"GH200.*(144G|HBM3e)", 146944,
             profiles=_seven_way(18, 36, 72, 144, whole_mib=146944)),
    GpuModel("H100-96GB", r"GH200|H100.*96GB", 98304, profiles=_seven_way(12, 24, 48, 96, whole_mib=98304)),
    GpuModel("H100-94GB", r"H100.*(NVL|94GB)", 95830, profiles=_seven_way(12, 24, 47, 94, whole_mib=95830)),
    GpuModel("H100-80GB", r"H100", 81559, profiles=_seven_way(10, 20, 40, 80, whole_mib=81559)),
    GpuModel("H200-141GB", r"H200", 143771, profiles=_seven_way(18, 35, 71, 141, whole_mib=143771)),
    GpuModel("B200-180GB", r"(?<!G)B200", 183359, profiles=_seven_way(23, 45, 90, 180, whole_mib=183359)),
    # Not MIG-capable, listed so their memory is known when a node lacks nvidia.com/gpu.memory.
    GpuModel("L40S", r"L40S", 46068),
    GpuModel("L4", r"\bL4\b", 23034),
    GpuModel("T4", r"\bT4\b", 15360),
    GpuModel("A10G", r"A10G", 23028),
    GpuModel("V100", r"V100", 16384),
)
"""Order matters: the first pattern that matches a product label wins (GH200 before H200 and H100, H100
NVL before H100). GH200 is the 96 GB part (``NVIDIA-GH200-480GB``) unless its label says 144G/HBM3e; the
GH200-144GB profiles come from MIG manager's configs (the MIG guide has no table for it), and the
placements of H200, GH200 and B200 follow the geometry they share with A100/H100 (same slice counts),
not an ``nvidia-smi mig -lgipp`` listing. GB200 and the RTX PRO parts (``+gfx``, ``+me.all``, ``-me``)
are not listed yet: a node with them serves whole GPUs only."""
CATALOGUE_BY_KEY = {model.key: model for model in CATALOGUE}



def base_product(product: str) -> str:
    """The product label without what the device plugin appends: ``-MIG-<profile>`` (MIG single
    strategy) and ``-SHARED`` (time-slicing)."""
    product = product.removesuffix("-SHARED")
    return re.sub(r"-MIG-([0-9]g\.[0-9]+gb([+.]me)?|INVALID)$", "", product)


def single_profile(product: str) -> str | None:
    """The MIG profile in a single-strategy product label (``NVIDIA-A100-SXM4-40GB-MIG-1g.5gb``)."""
    match = re.search(r"-MIG-([0-9]g\.[0-9]+gb)([+.]me)?(-SHARED)?$", product)
    return match.group(1) + ("+me" if match.group(2) else "") if match else None


def label_name(profile: str) -> str:
    """How GFD writes a profile inside label names (``nvidia.com/mig-1g.10gb.me.count``)."""
    return profile.replace("+", ".")


@functools.lru_cache(maxsize=256)
def model_for_product(product: str) -> GpuModel | None:
    """The catalogue entry for a ``nvidia.com/gpu.product`` value, or None for a GPU it does not list."""
    base = base_product(product)
    return next((m for m in CATALOGUE if re.search(m.product_pattern, base)), None)


def resource_name(profile: str) -> str:
    """``nvidia.com/mig-<profile>`` as the device plugin advertises it: ``+me`` becomes ``.me``
    (``+`` is not legal in a resource name)."""
    return MIG_PREFIX + profile.replace("+", ".")


def profile_of_resource(resource: str) -> str | None:
    """The MIG profile an extended resource name stands for (``nvidia.com/mig-1g.10gb.me`` ->
    ``1g.10gb+me``), or None when it is not a MIG resource."""
    if not resource.startswith(MIG_PREFIX):
        return None
    name = resource[len(MIG_PREFIX):]
    if name.endswith(".me"):
        name = name[:-3] + "+me"
    return name if PROFILE_PATTERN.match(name) else None


def profile_of_shared_resource(resource: str) -> str | None:
    """The MIG profile of a time-sliced slice the device plugin renamed (``renameByDefault``):
    ``nvidia.com/mig-1g.10gb.shared`` -> ``1g.10gb``; None for any other resource."""
    if not resource.endswith(SHARED_SUFFIX):
        return None
    return profile_of_resource(resource[:-len(SHARED_SUFFIX)])


def mig_label(profile: str, field: str) -> str:
    """GFD's per-MIG-type label under the mixed strategy: ``nvidia.com/mig-1g.10gb.<field>``."""
    return f"{MIG_PREFIX}{label_name(profile)}.{field}"


def known_profiles(models: Iterable[GpuModel] = CATALOGUE) -> tuple[str, ...]:
    """Every profile name of ``models``, smallest first."""
    names = {p.name for m in models for p in m.profiles}
    return tuple(sorted(names, key=profile_sort_key))


def profile_sort_key(name: str) -> tuple[int, int, int, str]:
    """Order profiles by memory, then compute, media-less first: the order 'smallest that fits' uses."""
    match = PROFILE_PATTERN.match(name)
    if not match:
        return (1 << 30, 0, 0, name)
    return (int(match["gb"]), int(match["g"]), 1 if match["me"] else 0, name)


def models_with(profile: str) -> tuple[GpuModel, ...]:
    """The catalogue GPUs that offer ``profile``."""
    return tuple(m for m in CATALOGUE if m.profile(profile) is not None)


Layout = tuple[tuple[str, int], ...]
"""A GPU's MIG partition: (profile, start memory slice) per instance, sorted by start."""


def valid_layout(model: GpuModel, layout: Layout) -> bool:
    """Whether ``layout`` is a partition NVIDIA allows on one ``model`` GPU."""
    memory = [False] * model.memory_slices
    compute = [False] * model.compute_slices
    media = 0
    for name, start in layout:
        profile = model.profile(name)
        if profile is None or start not in profile.starts:
            return False
        if start + profile.memory > model.memory_slices or start + profile.compute > model.compute_slices:
            return False
        for i in range(start, start + profile.memory):
            if memory[i]:
                return False
            memory[i] = True
        for i in range(start, start + profile.compute):
            if compute[i]:
                return False
            compute[i] = True
        media += profile.media
    return media <= 1


def pack(model: GpuModel, wanted: Sequence[str], fixed: Layout = ()) -> Layout | None:
    """A valid layout holding every instance of ``fixed`` where it is plus one instance per entry of
    ``wanted``, or None when they do not fit on one GPU. Deterministic: largest profiles are placed
    first, each at its lowest free allowed start."""
    return _pack(model, tuple(wanted), tuple(fixed))


@functools.lru_cache(maxsize=65536)
def _pack(model: GpuModel, wanted: tuple[str, ...], fixed: Layout) -> Layout | None:
    """:func:`pack`, remembered: a planner asks the same question of every GPU partitioned alike."""
    profiles = []
    for name in wanted:
        profile = model.profile(name)
        if profile is None:
            return None
        profiles.append(profile)
    profiles.sort(key=lambda p: (-p.memory, -p.compute, p.name))
    if not valid_layout(model, fixed):
        return None

    def place(index: int, layout: Layout, after: int) -> Layout | None:
        if index == len(profiles):
            return layout
        profile = profiles[index]
        for start in profile.starts:
            # Instances of one profile are interchangeable: trying them in rising starts only finds the
            # same first layout without retrying every order of them (8 x 1g that cannot fit took ~1 s).
            if start <= after:
                continue
            candidate = tuple(sorted((*layout, (profile.name, start)), key=lambda item: (item[1], item[0])))
            if valid_layout(model, candidate):
                same = index + 1 < len(profiles) and profiles[index + 1].name == profile.name
                found = place(index + 1, candidate, start if same else -1)
                if found is not None:
                    return found
        return None

    return place(0, tuple(sorted(fixed, key=lambda item: (item[1], item[0]))), -1)


@functools.lru_cache(maxsize=512)
def max_instances(model: GpuModel, profile: str) -> int:
    """How many instances of ``profile`` one ``model`` GPU holds (0: not its profile)."""
    count = 0
    while count < model.memory_slices and pack(model, [profile] * (count + 1)) is not None:
        count += 1
    return count


def used_slices(model: GpuModel, layout: Layout) -> tuple[int, int]:
    """(compute slices, memory slices) a layout holds."""
    compute = memory = 0
    for name, _ in layout:
        profile = model.profile(name)
        if profile is not None:
            compute += profile.compute
            memory += profile.memory
    return compute, memory
