//! What a directory holds, for tests that check a command changed (or copied) exactly what it
//! should. Shared by the test binaries (`#[path]`).

use std::collections::BTreeMap;
use std::path::Path;

/// Every file of `dir` and of its folders (the commit log's), by its path under `dir`, with
/// its bytes: a backup must come out of a restore as it went in.
pub fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    add_contents(dir, "", &mut files);
    files
}

fn add_contents(dir: &Path, prefix: &str, files: &mut BTreeMap<String, Vec<u8>>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
        if entry.file_type().unwrap().is_dir() {
            add_contents(&entry.path(), &format!("{name}/"), files);
        } else {
            files.insert(name, std::fs::read(entry.path()).unwrap());
        }
    }
}

/// The names in `dir` with their lengths in bytes, sorted by name. A file removed or renamed
/// between the listing and its length (a running store's log: a segment made ahead of need is
/// renamed into place, a quiet store's segments are removed) is left out.
#[allow(dead_code)] // not every test binary lists lengths
pub fn lengths(dir: &Path) -> Vec<(String, u64)> {
    let mut lengths: Vec<(String, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|entry| {
            let entry = entry.unwrap();
            let name = entry.file_name().to_string_lossy().into_owned();
            match entry.metadata() {
                Ok(metadata) => Some((name, metadata.len())),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => None,
                Err(error) => panic!("{name}: {error}"),
            }
        })
        .collect();
    lengths.sort();
    lengths
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
