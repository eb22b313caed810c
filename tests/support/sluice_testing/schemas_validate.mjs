// Runs the published validators of third-party custom resources for sluice_testing/schemas.py.
//
//   node schemas_validate.mjs <node_modules>   < [obj, ...]   > [[problem, ...], ...]
//
// <node_modules> holds the @kubernetes-models packages (.ci/tools.sh installs them). Each package has
// <group>/<version>/<Kind>.js exporting a model class whose prototype.validate runs the ajv-compiled
// schema on `this`. The object is passed wrapped in a Proxy that records which fields the validator
// reads (or enumerates): a field it never looked at is one the schema does not know, which the API
// server would prune without a word, so it is reported too. A free-form object (one the validator
// never looked into, e.g. x-kubernetes-preserve-unknown-fields) is not.
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const scope = path.join(process.argv[2], "@kubernetes-models");
const support = new Set(["apimachinery", "base", "validate"]);
const packages = fs.readdirSync(scope).filter((name) => !support.has(name));

function locate(apiVersion, kind) {
  if (!/^[a-z0-9.-]+\/v[0-9a-z]+$/.test(apiVersion ?? "") || !/^[A-Za-z0-9]+$/.test(kind ?? "")) return null;
  for (const name of packages) {
    const file = path.join(scope, name, apiVersion, `${kind}.js`);
    if (fs.existsSync(file)) return file;
  }
  return null;
}

function recording(value, pointer, seen) {
  if (value === null || typeof value !== "object") return value;
  if (!seen.has(pointer)) seen.set(pointer, { read: new Set(), enumerated: false });
  const record = seen.get(pointer);
  return new Proxy(value, {
    get(target, key, receiver) {
      const child = Reflect.get(target, key, receiver);
      if (typeof key !== "string") return child;
      record.read.add(key);
      return Object.hasOwn(target, key) ? recording(child, `${pointer}/${key}`, seen) : child;
    },
    ownKeys(target) {
      record.enumerated = true;
      return Reflect.ownKeys(target);
    },
  });
}

function unknownFields(value, pointer, seen, problems) {
  if (value === null || typeof value !== "object") return;
  const record = seen.get(pointer);
  if (record === undefined) return;
  const free = Array.isArray(value) || record.enumerated || record.read.size === 0;
  for (const key of Object.keys(value)) {
    const child = `${pointer}/${key}`;
    if (!free && !record.read.has(key)) {
      problems.push(`${child}: unknown field (not in the published schema; the API server would prune it)`);
    } else {
      unknownFields(value[key], child, seen, problems);
    }
  }
}

function describe(error) {
  let text = `${error.instancePath || "/"}: ${error.message}`;
  if (error.params?.allowedValues) text += ` (${error.params.allowedValues.join(", ")})`;
  return text;
}

const results = [];
for (const obj of JSON.parse(fs.readFileSync(0, "utf8"))) {
  const file = locate(obj?.apiVersion, obj?.kind);
  if (file === null) {
    results.push([`no published schema for apiVersion ${obj?.apiVersion} kind ${obj?.kind} (have: ${packages.join(", ")})`]);
    continue;
  }
  const model = (await import(pathToFileURL(file).href))[obj.kind];
  const seen = new Map();
  const problems = [];
  try {
    model.prototype.validate.call(recording(obj, "", seen));
  } catch (error) {
    for (const e of error.errors ?? [{ instancePath: "", message: String(error) }]) problems.push(describe(e));
  }
  unknownFields(obj, "", seen, problems);
  results.push(problems);
}
process.stdout.write(JSON.stringify(results));
