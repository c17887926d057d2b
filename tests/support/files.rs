//! What a directory holds, for tests that check a command changed (or copied) exactly what it
//! should. Shared by the test binaries (`#[path]`).

use std::collections::BTreeMap;
use std::path::Path;

/// Every file of `dir` with its bytes: a backup must come out of a restore as it went in.
pub fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(entry.path()).unwrap())
        })
        .collect()
}

/// The names in `dir`, sorted: what a refused command must not have added to.
pub fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}
