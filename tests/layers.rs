//! Guards the crate's structure (ARCHITECTURE.md, Codemap): every module of `src/` belongs to a
//! layer, and a module names only modules of its own layer or of layers below it, so no import
//! cycle can form. Reads the sources as text, like a reviewer would; doc comments and unit-test
//! modules do not count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The layers, bottom first, as ARCHITECTURE.md lists them. `format` is the public module
/// `lib.rs` declares inline.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "format",
        &[
            "clock",
            "error",
            "fingerprint",
            "format",
            "key",
            "merge",
            "merge_ops",
            "message",
            "operand",
            "printable",
            "record",
            "transfer",
            "ttl",
        ],
    ),
    ("decision core", &["decision"]),
    (
        "storage",
        &[
            "business_table",
            "committer",
            "fault",
            "latch",
            "observe",
            "options",
            "storage",
            "store_lock",
            "store_meta",
        ],
    ),
    ("operations", &["batch", "claim", "lease", "staging"]),
    ("handles", &["admin", "engine"]),
];

/// The layer index of `module`, if it is listed.
fn layer_of(module: &str) -> Option<usize> {
    LAYERS
        .iter()
        .position(|(_, modules)| modules.contains(&module))
}

/// Every module of `src/` (a folder counts as one module; the binary is a crate of its own)
/// with the modules its code names through `crate::`.
fn imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut found: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
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
        if path.extension().is_none_or(|extension| extension != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let (module, text) = if path.ends_with("lib.rs") {
            // Of lib.rs only the inline `format` module counts: it re-exports from others.
            let start = text
                .find("pub mod format {")
                .expect("lib.rs declares `format`");
            let end = start + text[start..].find("\n}").unwrap();
            ("format".to_owned(), text[start..end].to_owned())
        } else {
            let relative = path.strip_prefix(src).unwrap();
            let module = relative.components().next().unwrap().as_os_str();
            let module = module.to_str().unwrap().trim_end_matches(".rs").to_owned();
            (module, text)
        };
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
                    .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                // `crate::Error` and other root re-exports start with a capital: not a module.
                if !name.is_empty() && name != module {
                    named.insert(name);
                }
            }
        }
    }
    found
}

#[test]
fn every_module_names_only_its_own_layer_or_lower_ones() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let imports = imports(&src);
    let mut problems = Vec::new();
    for (module, named) in &imports {
        let Some(layer) = layer_of(module) else {
            problems.push(format!(
                "{module} is in no layer: add it to ARCHITECTURE.md and here"
            ));
            continue;
        };
        for target in named {
            match layer_of(target) {
                Some(target_layer) if target_layer <= layer => {}
                Some(target_layer) => problems.push(format!(
                    "{module} ({}) names {target} ({}), a layer above it",
                    LAYERS[layer].0, LAYERS[target_layer].0
                )),
                None => problems.push(format!("{module} names {target}, which is in no layer")),
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn no_import_cycle_among_the_modules() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let imports = imports(&src);
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
        let cycle = visit(module, &imports, &mut Vec::new(), &mut done);
        assert!(
            cycle.is_none(),
            "import cycle: {}",
            cycle.unwrap().join(" -> ")
        );
    }
}
