//! Guards both crates' structure (ARCHITECTURE.md, Codemap): every module belongs to a layer, a
//! layer is a folder of `src/` (or, for a layer of one or two files, those files at the top), and
//! a module names only modules of its own layer or of layers below it, by their module paths:
//! never through the crate root's re-exports, which would hide the direction. So no import
//! cycle can form between layers. Reads the sources as text, like a reviewer would; comments
//! and unit-test modules do not count. No import cycle either among the files (a folder and its
//! files being one room).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// A crate's layers, bottom first: each a name and the top-level modules of `src/` it holds (a
/// folder counts as one module).
type Layers = &'static [(&'static str, &'static [&'static str])];

/// The embedded crate's layers, as ARCHITECTURE.md lists them. `merge_ops` and `transfer` are
/// files of `format/` that the crate root declares itself (`#[path]`), to keep their public
/// paths `idemdb::merge_ops` and `idemdb::transfer`.
const ENGINE_LAYERS: Layers = &[
    ("format", &["format", "merge_ops", "transfer"]),
    ("decision core", &["decision"]),
    ("storage", &["storage"]),
    ("operations", &["operations"]),
    ("handles", &["admin", "consumer", "engine"]),
];

/// The PostgreSQL crate's layers, as ARCHITECTURE.md lists them.
const POSTGRES_LAYERS: Layers = &[
    ("errors", &["error"]),
    ("connection", &["sql"]),
    ("tables", &["tables"]),
    ("storage", &["storage"]),
    ("operations", &["operations"]),
];

/// What the code of one module of `src/` names.
#[derive(Default)]
struct Named {
    /// Top-level modules named through `crate::module`.
    modules: BTreeSet<String>,
    /// Lines that name a root re-export (`crate::Error`, `crate::LIMIT_MAX`).
    root_reexports: Vec<String>,
}

/// Every top-level module of `src` (a folder counts as one; `lib.rs` and the binaries are the
/// top and are left out) with what its code names.
fn imports(src: &Path) -> BTreeMap<String, Named> {
    let mut found: BTreeMap<String, Named> = BTreeMap::new();
    let mut files = vec![src.to_path_buf()];
    while let Some(path) = files.pop() {
        if path.is_dir() {
            if path.ends_with("bin") {
                continue;
            }
            for entry in std::fs::read_dir(&path).unwrap() {
                files.push(entry.unwrap().path());
            }
            continue;
        }
        if path.extension().is_none_or(|extension| extension != "rs") || path.ends_with("lib.rs") {
            continue;
        }
        let relative = path.strip_prefix(src).unwrap();
        let module = relative.components().next().unwrap().as_os_str();
        let module = module.to_str().unwrap().trim_end_matches(".rs").to_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        let named = found.entry(module.clone()).or_default();
        for line in text.lines().map(str::trim_start) {
            // Unit tests, at the end of a file by convention, may reach anywhere.
            if line.starts_with("#[cfg(test)]") {
                break;
            }
            if line.starts_with("//") {
                continue;
            }
            for (at, _) in line.match_indices("crate::") {
                let rest = &line[at + "crate::".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if name.starts_with(|c: char| c.is_ascii_uppercase()) {
                    named
                        .root_reexports
                        .push(format!("{}: {}", relative.display(), line.trim()));
                } else if !name.is_empty() && name != module {
                    named.modules.insert(name);
                }
            }
        }
    }
    found
}

/// What is wrong with the layering of `src`: a module in no layer, a name of a layer above,
/// a root re-export named.
fn layering_problems(src: &Path, layers: Layers) -> Vec<String> {
    let layer_of = |module: &str| {
        layers
            .iter()
            .position(|(_, modules)| modules.contains(&module))
    };
    let mut problems = Vec::new();
    for (module, named) in &imports(src) {
        let Some(layer) = layer_of(module) else {
            problems.push(format!(
                "{module} is in no layer: add it to ARCHITECTURE.md and here"
            ));
            continue;
        };
        for target in &named.modules {
            match layer_of(target) {
                Some(target_layer) if target_layer <= layer => {}
                Some(target_layer) => problems.push(format!(
                    "{module} ({}) names {target} ({}), a layer above it",
                    layers[layer].0, layers[target_layer].0
                )),
                None => problems.push(format!("{module} names {target}, which is in no layer")),
            }
        }
        for line in &named.root_reexports {
            problems.push(format!(
                "{line}: names a root re-export; name it by its module path"
            ));
        }
    }
    problems
}

/// An import cycle among the top-level modules of `src`, if there is one.
fn import_cycle(src: &Path) -> Option<Vec<String>> {
    let imports: BTreeMap<String, BTreeSet<String>> = imports(src)
        .into_iter()
        .map(|(module, named)| (module, named.modules))
        .collect();
    cycle_in(&imports)
}

/// Every file of `src` as its module path (`storage::log::commit_log`; a folder's `mod.rs` is
/// the folder's), with the other files it names: through `crate::` paths (the longest prefix
/// that is a file) and `super::` paths. A folder and the files inside it are one room: a file
/// uses its folder's items and the folder re-exports its files', so names between a module
/// and its own ancestors or descendants are left out. Binaries, comments and unit tests do not
/// count.
fn file_imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut texts = BTreeMap::new();
    let mut files = vec![src.to_path_buf()];
    while let Some(path) = files.pop() {
        if path.is_dir() {
            if !path.ends_with("bin") {
                files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
            }
            continue;
        }
        if path.extension().is_none_or(|extension| extension != "rs") || path.ends_with("lib.rs") {
            continue;
        }
        let relative = path.strip_prefix(src).unwrap().with_extension("");
        let mut parts: Vec<String> = relative
            .components()
            .map(|part| part.as_os_str().to_str().unwrap().to_owned())
            .collect();
        if parts.last().is_some_and(|last| last == "mod") {
            parts.pop();
        }
        texts.insert(parts.join("::"), std::fs::read_to_string(&path).unwrap());
    }
    let related = |a: &str, b: &str| {
        a == b || a.starts_with(&format!("{b}::")) || b.starts_with(&format!("{a}::"))
    };
    let mut imports = BTreeMap::new();
    for (module, text) in &texts {
        let parent = module.rsplit_once("::").map_or("", |(parent, _)| parent);
        let mut named = BTreeSet::new();
        for line in text.lines().map(str::trim_start) {
            if line.starts_with("#[cfg(test)]") {
                break;
            }
            if line.starts_with("//") {
                continue;
            }
            for (prefix, base) in [("crate::", ""), ("super::", parent)] {
                for (at, _) in line.match_indices(prefix) {
                    if line[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
                        continue;
                    }
                    let path: Vec<&str> = line[at + prefix.len()..]
                        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                        .next()
                        .unwrap_or("")
                        .split("::")
                        .filter(|part| !part.is_empty())
                        .collect();
                    let base: Vec<&str> = base.split("::").filter(|p| !p.is_empty()).collect();
                    let target = (1..=path.len()).rev().find_map(|len| {
                        let candidate = [&base[..], &path[..len]].concat().join("::");
                        texts.contains_key(&candidate).then_some(candidate)
                    });
                    if let Some(target) = target.filter(|target| !related(module, target)) {
                        named.insert(target);
                    }
                }
            }
        }
        imports.insert(module.clone(), named);
    }
    imports
}

/// A cycle in `imports` (module -> the modules it names), if there is one.
fn cycle_in(imports: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    // Depth-first search; a module met again while still on the path closes a cycle.
    fn visit<'a>(
        module: &'a str,
        imports: &'a BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<&'a str>> {
        if let Some(start) = path.iter().position(|on_path| *on_path == module) {
            let mut cycle = path[start..].to_vec();
            cycle.push(module);
            return Some(cycle);
        }
        if !done.insert(module) {
            return None;
        }
        path.push(module);
        for next in imports.get(module).into_iter().flatten() {
            if let Some(cycle) = visit(next, imports, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    for module in imports.keys() {
        if let Some(cycle) = visit(module, imports, &mut Vec::new(), &mut done) {
            return Some(cycle.into_iter().map(str::to_owned).collect());
        }
    }
    None
}

fn engine_src() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn postgres_src() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("postgres/src")
}

fn e2e_src() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e/src")
}

#[test]
fn every_module_names_only_its_own_layer_or_lower_ones() {
    let problems = layering_problems(&engine_src(), ENGINE_LAYERS);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_postgres_crate_names_only_its_own_layer_or_lower_ones() {
    let problems = layering_problems(&postgres_src(), POSTGRES_LAYERS);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn no_import_cycle_among_the_modules() {
    for src in [engine_src(), postgres_src(), e2e_src()] {
        let cycle = import_cycle(&src);
        assert!(
            cycle.is_none(),
            "import cycle in {}: {}",
            src.display(),
            cycle.unwrap_or_default().join(" -> ")
        );
    }
}

#[test]
fn no_import_cycle_among_the_files() {
    for (src, fewest) in [(engine_src(), 20), (postgres_src(), 20), (e2e_src(), 10)] {
        let imports = file_imports(&src);
        assert!(imports.len() > fewest, "{}: files not found", src.display());
        let cycle = cycle_in(&imports);
        assert!(
            cycle.is_none(),
            "import cycle among the files of {}: {}",
            src.display(),
            cycle.unwrap_or_default().join(" -> ")
        );
    }
}
