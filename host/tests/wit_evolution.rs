//! The WIT evolution rule, checked on the text: each version holds every
//! item of the one before unchanged — the frozen 0.2.0 copy
//! (`wit/compat/v0.2.0`) those of 0.1.0 (`wit/compat/v0.1.0`, all marked
//! `@since(version = 0.1.0)`), the frozen 0.3.0 copy (`wit/compat/v0.3.0`)
//! those of 0.2.0, `wit/` (0.4.0) those of 0.3.0 — and every item it adds
//! is marked with the version that added it.

use std::collections::BTreeMap;
use std::path::Path;

use wit_parser::{PackageId, Resolve, Stability, Type, TypeDefKind, WorldItem};

/// `wasmem:policy` at `dir`, in `r`.
fn package(r: &mut Resolve, dir: &str) -> PackageId {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(dir);
    r.push_dir(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display())).0
}

fn ty(r: &Resolve, t: &Type) -> String {
    match t {
        Type::Id(id) => match &r.types[*id].name {
            Some(name) => name.clone(),
            None => kind(r, &r.types[*id].kind),
        },
        primitive => format!("{primitive:?}").to_lowercase(),
    }
}

fn opt(r: &Resolve, t: &Option<Type>) -> String {
    t.as_ref().map_or_else(|| "_".to_string(), |t| ty(r, t))
}

/// A type definition as text, naming the types it refers to (so that the
/// same definition in two packages gives the same text).
fn kind(r: &Resolve, k: &TypeDefKind) -> String {
    let join = |v: Vec<String>| v.join(", ");
    match k {
        TypeDefKind::Record(x) => {
            format!("record {{ {} }}", join(x.fields.iter().map(|f| format!("{}: {}", f.name, ty(r, &f.ty))).collect()))
        }
        TypeDefKind::Variant(x) => format!(
            "variant {{ {} }}",
            join(x.cases.iter().map(|c| format!("{}({})", c.name, opt(r, &c.ty))).collect())
        ),
        TypeDefKind::Enum(x) => format!("enum {{ {} }}", join(x.cases.iter().map(|c| c.name.clone()).collect())),
        TypeDefKind::Flags(x) => format!("flags {{ {} }}", join(x.flags.iter().map(|f| f.name.clone()).collect())),
        TypeDefKind::Tuple(x) => format!("tuple<{}>", join(x.types.iter().map(|t| ty(r, t)).collect())),
        TypeDefKind::Option(t) => format!("option<{}>", ty(r, t)),
        TypeDefKind::List(t) => format!("list<{}>", ty(r, t)),
        TypeDefKind::Result(x) => format!("result<{}, {}>", opt(r, &x.ok), opt(r, &x.err)),
        TypeDefKind::Type(t) => format!("= {}", ty(r, t)),
        other => panic!("the policy package uses no {other:?}"),
    }
}

fn since(s: &Stability) -> String {
    match s {
        Stability::Stable { since, .. } => since.to_string(),
        other => panic!("every item carries @since, found {other:?}"),
    }
}

/// Every item of a package: `interface/item` or `world/import|export` → (definition, since).
fn items(r: &Resolve, pkg: PackageId) -> BTreeMap<String, (String, String)> {
    let mut out = BTreeMap::new();
    for (iname, &iid) in &r.packages[pkg].interfaces {
        let i = &r.interfaces[iid];
        out.insert(iname.clone(), ("interface".to_string(), since(&i.stability)));
        for (tname, &tid) in &i.types {
            let t = &r.types[tid];
            out.insert(format!("{iname}/{tname}"), (kind(r, &t.kind), since(&t.stability)));
        }
        for (fname, f) in &i.functions {
            let params: Vec<String> = f.params.iter().map(|p| format!("{}: {}", p.name, ty(r, &p.ty))).collect();
            let sig = format!("func({}) -> {}", params.join(", "), opt(r, &f.result));
            out.insert(format!("{iname}/{fname}"), (sig, since(&f.stability)));
        }
    }
    for (wname, &wid) in &r.packages[pkg].worlds {
        let w = &r.worlds[wid];
        out.insert(wname.clone(), ("world".to_string(), since(&w.stability)));
        for (dir, map) in [("import", &w.imports), ("export", &w.exports)] {
            for (key, item) in map {
                let WorldItem::Interface { id, stability, .. } = item else { continue };
                let name = r.interfaces[*id].name.clone().unwrap_or_else(|| r.name_world_key(key));
                out.insert(format!("{wname}/{dir} {name}"), (dir.to_string(), since(stability)));
            }
        }
    }
    out
}

/// Checks that the package at `new_dir` (version `new_v`) keeps every item
/// of the one at `old_dir` (version `old_v`) unchanged, and that the items
/// it adds say `@since(version = new_v)`; returns the added items.
fn evolution(old_dir: &str, old_v: &str, new_dir: &str, new_v: &str) -> Vec<String> {
    let mut r = Resolve::default();
    let old = package(&mut r, old_dir);
    let new = package(&mut r, new_dir);
    assert_eq!(r.packages[old].name.to_string(), format!("wasmem:policy@{old_v}"));
    assert_eq!(r.packages[new].name.to_string(), format!("wasmem:policy@{new_v}"));
    let (old, new) = (items(&r, old), items(&r, new));
    for (name, (def, since)) in &old {
        let (new_def, new_since) = new.get(name).unwrap_or_else(|| panic!("{new_v} removed `{name}`"));
        assert_eq!(new_def, def, "{new_v} changed `{name}`");
        assert_eq!(new_since, since, "{new_v} changed the @since of `{name}`");
    }
    let added: Vec<String> = new.keys().filter(|k| !old.contains_key(*k)).cloned().collect();
    for name in &added {
        assert_eq!(new[name].1, new_v, "`{name}` is new in {new_v} and must say @since(version = {new_v})");
    }
    added
}

#[test]
fn wit_0_2_0_keeps_every_item_of_0_1_0_and_marks_what_it_adds() {
    let mut r = Resolve::default();
    let old = package(&mut r, "wit/compat/v0.1.0");
    for (name, (_, since)) in items(&r, old) {
        assert_eq!(since, "0.1.0", "{name} in the frozen 0.1.0 copy");
    }
    let added = evolution("wit/compat/v0.1.0", "0.1.0", "wit/compat/v0.2.0", "0.2.0");
    assert_eq!(
        added,
        [
            "reclamation/paged-segments",
            "reclamation/plan",
            "reclamation/reclaim-plan",
            "types/compaction",
            "types/reclaim-plan"
        ],
        "the items 0.2.0 adds"
    );
}

#[test]
fn wit_0_3_0_keeps_every_item_of_0_2_0_and_marks_what_it_adds() {
    let added = evolution("wit/compat/v0.2.0", "0.2.0", "wit/compat/v0.3.0", "0.3.0");
    assert_eq!(
        added,
        [
            "full-planned-policy",
            "full-planned-policy/export eviction",
            "full-planned-policy/export lifecycle",
            "full-planned-policy/export placement",
            "full-planned-policy/export planner",
            "full-planned-policy/export reclamation",
            "full-planned-policy/import host",
            "full-planned-policy/import types",
            "planner",
            "planner-policy",
            "planner-policy/export lifecycle",
            "planner-policy/export planner",
            "planner-policy/import host",
            "planner-policy/import types",
            "planner/arena-plan",
            "planner/plan",
            "planner/step-profile",
            "types/arena-plan",
            "types/plan-request",
            "types/step-profile",
        ],
        "the items 0.3.0 adds"
    );
}

#[test]
fn wit_0_4_0_keeps_every_item_of_0_3_0_and_marks_what_it_adds() {
    let added = evolution("wit/compat/v0.3.0", "0.3.0", "wit", "0.4.0");
    assert_eq!(added, ["planner/aliased-plan", "planner/plan-aliased", "types/aliased-plan"], "the items 0.4.0 adds");
}

#[test]
fn the_frozen_copies_are_the_text_of_their_versions() {
    // Only the package line may differ between a version and the frozen
    // copy of the one before, for the files the version did not add to.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let read = |dir: &str, f: &str| std::fs::read_to_string(root.join(format!("{dir}/{f}.wit"))).unwrap();
    for f in ["eviction", "host", "lifecycle", "placement"] {
        let (v2, v3, v4) = (read("wit/compat/v0.2.0", f), read("wit/compat/v0.3.0", f), read("wit", f));
        assert_eq!(v2.replace("@0.2.0;", "@0.3.0;"), v3, "{f}.wit: 0.2.0 and 0.3.0");
        assert_eq!(v3.replace("@0.3.0;", "@0.4.0;"), v4, "{f}.wit: 0.3.0 and 0.4.0");
    }
    for f in ["reclamation", "worlds"] {
        assert_eq!(
            read("wit/compat/v0.3.0", f).replace("@0.3.0;", "@0.4.0;"),
            read("wit", f),
            "{f}.wit: 0.3.0 and 0.4.0"
        );
    }
}
