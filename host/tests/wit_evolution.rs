//! The WIT evolution rule, checked on the text: `wit/` (0.2.0) holds every
//! item of the frozen 0.1.0 copy (`wit/compat/v0.1.0`) unchanged and marked
//! `@since(version = 0.1.0)`, and every item it adds is marked with the
//! version that added it.

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

#[test]
fn wit_0_2_0_keeps_every_item_of_0_1_0_and_marks_what_it_adds() {
    let mut r = Resolve::default();
    let old = package(&mut r, "wit/compat/v0.1.0");
    let new = package(&mut r, "wit");
    assert_eq!(r.packages[old].name.to_string(), "wasmem:policy@0.1.0");
    assert_eq!(r.packages[new].name.to_string(), "wasmem:policy@0.2.0");
    let (old, new) = (items(&r, old), items(&r, new));
    for (name, (def, since)) in &old {
        assert_eq!(since, "0.1.0", "{name} in the frozen 0.1.0 copy");
        let (new_def, new_since) = new.get(name).unwrap_or_else(|| panic!("0.2.0 removed `{name}`"));
        assert_eq!(new_def, def, "0.2.0 changed `{name}`");
        assert_eq!(new_since, since, "0.2.0 changed the @since of `{name}`");
    }
    let added: Vec<&String> = new.keys().filter(|k| !old.contains_key(*k)).collect();
    for name in &added {
        assert_eq!(new[*name].1, "0.2.0", "`{name}` is new in 0.2.0 and must say @since(version = 0.2.0)");
    }
    let added: Vec<&str> = added.iter().map(|s| s.as_str()).collect();
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
