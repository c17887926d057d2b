//! The file system's state: every file's bytes as the programs see them, and the bytes a power
//! cut would leave; every directory's entries as seen, and the entries a cut would leave.
//!
//! The rules are strict POSIX, stricter than ext4 (whose journal often saves a new file's
//! entry with its data):
//! - a file's bytes and size become durable when the file is fsynced (`fsync` and `fdatasync`
//!   alike: the size is what makes appended data readable);
//! - a directory's entries (create, link, unlink, rename in or out) become durable when the
//!   directory itself is fsynced;
//! - a file that is still durably linked somewhere keeps its durable bytes after it is
//!   unlinked or renamed away, until its directory is fsynced.
//!
//! Nodes are never freed while mounted: a durable entry may still name a node that is gone
//! from every directory, and a mount lives for one test cycle.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::SystemTime;

pub(crate) type Ino = u64;
pub(crate) const ROOT: Ino = 1;

/// A failed operation's errno, as the kernel will see it.
pub(crate) type Errno = i32;

/// How much of the volume a sector is: a torn write keeps whole sectors only.
pub const SECTOR: u64 = 512;

pub(crate) struct FileBody {
    /// What reads see.
    data: Vec<u8>,
    /// What a power cut leaves.
    durable: Vec<u8>,
    /// Lowest offset written (or truncated to) since the last fsync: below it `data` and
    /// `durable` agree, so an fsync copies only from here.
    dirty_from: Option<u64>,
}

pub(crate) struct DirBody {
    entries: BTreeMap<OsString, Ino>,
    durable: BTreeMap<OsString, Ino>,
}

pub(crate) enum Body {
    File(FileBody),
    Dir(DirBody),
}

pub(crate) struct Node {
    pub(crate) body: Body,
    pub(crate) perm: u16,
    /// Links in the directories as seen (a directory counts its own entry only).
    pub(crate) nlink: u32,
    /// The name of its latest entry, for triggers that match on names.
    pub(crate) name: OsString,
    pub(crate) mtime: SystemTime,
}

impl Node {
    pub(crate) fn is_dir(&self) -> bool {
        matches!(self.body, Body::Dir(_))
    }

    pub(crate) fn size(&self) -> u64 {
        match &self.body {
            Body::File(file) => file.data.len() as u64,
            Body::Dir(dir) => dir.entries.len() as u64,
        }
    }
}

/// Which state to write out.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum View {
    /// As the programs saw it: a clean unmount.
    Current,
    /// What survives a power cut.
    Durable,
}

/// Counts of what the programs asked for, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// `write` requests.
    pub writes: u64,
    /// Bytes those requests carried.
    pub bytes_written: u64,
    /// `fsync`/`fdatasync` of files.
    pub file_syncs: u64,
    /// `fsync` of directories.
    pub dir_syncs: u64,
    /// Renames.
    pub renames: u64,
    /// Files created (including directories).
    pub creates: u64,
    /// Entries removed.
    pub removes: u64,
}

pub(crate) struct Model {
    nodes: HashMap<Ino, Node>,
    next_ino: Ino,
    /// The latest write: (file, offset, length). A torn cut keeps part of it.
    last_write: Option<(Ino, u64, u64)>,
    pub(crate) stats: Stats,
}

impl Model {
    /// Loads a directory tree, all of it durable (it is what the last power-off left).
    pub(crate) fn load(backing: &Path) -> io::Result<Model> {
        let mut model = Model {
            nodes: HashMap::new(),
            next_ino: ROOT + 1,
            last_write: None,
            stats: Stats::default(),
        };
        model
            .nodes
            .insert(ROOT, new_dir(OsString::from("/"), 0o755));
        let mut seen = HashMap::new();
        model.load_dir(backing, ROOT, &mut seen)?;
        Ok(model)
    }

    fn load_dir(
        &mut self,
        dir: &Path,
        ino: Ino,
        seen: &mut HashMap<(u64, u64), Ino>,
    ) -> io::Result<()> {
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let meta = entry.path().symlink_metadata()?;
            let name = entry.file_name();
            let child = if let Some(&linked) = seen.get(&(meta.dev(), meta.ino())) {
                if let Ok(node) = self.node_mut(linked) {
                    node.nlink += 1;
                }
                linked
            } else {
                let perm = (meta.mode() & 0o7777) as u16;
                let node = if meta.is_dir() {
                    new_dir(name.clone(), perm)
                } else if meta.is_file() {
                    let data = std::fs::read(entry.path())?;
                    Node {
                        body: Body::File(FileBody {
                            durable: data.clone(),
                            data,
                            dirty_from: None,
                        }),
                        perm,
                        nlink: 1,
                        name: name.clone(),
                        mtime: meta.modified()?,
                    }
                } else {
                    return Err(io::Error::other(format!(
                        "{}: only files and directories are supported",
                        entry.path().display()
                    )));
                };
                let child = self.insert(node);
                if meta.is_dir() {
                    self.load_dir(&entry.path(), child, seen)?;
                } else {
                    seen.insert((meta.dev(), meta.ino()), child);
                }
                child
            };
            let parent = self.dir_mut(ino).map_err(io::Error::from_raw_os_error)?;
            parent.entries.insert(name.clone(), child);
            parent.durable.insert(name, child);
        }
        Ok(())
    }

    fn insert(&mut self, node: Node) -> Ino {
        let ino = self.next_ino;
        self.next_ino += 1;
        self.nodes.insert(ino, node);
        ino
    }

    pub(crate) fn node(&self, ino: Ino) -> Result<&Node, Errno> {
        self.nodes.get(&ino).ok_or(libc::ENOENT)
    }

    fn node_mut(&mut self, ino: Ino) -> Result<&mut Node, Errno> {
        self.nodes.get_mut(&ino).ok_or(libc::ENOENT)
    }

    fn dir(&self, ino: Ino) -> Result<&DirBody, Errno> {
        match &self.node(ino)?.body {
            Body::Dir(dir) => Ok(dir),
            Body::File(_) => Err(libc::ENOTDIR),
        }
    }

    fn dir_mut(&mut self, ino: Ino) -> Result<&mut DirBody, Errno> {
        match &mut self.node_mut(ino)?.body {
            Body::Dir(dir) => Ok(dir),
            Body::File(_) => Err(libc::ENOTDIR),
        }
    }

    fn file_mut(&mut self, ino: Ino) -> Result<&mut FileBody, Errno> {
        match &mut self.node_mut(ino)?.body {
            Body::File(file) => Ok(file),
            Body::Dir(_) => Err(libc::EISDIR),
        }
    }

    pub(crate) fn lookup(&self, parent: Ino, name: &OsStr) -> Result<Ino, Errno> {
        self.dir(parent)?
            .entries
            .get(name)
            .copied()
            .ok_or(libc::ENOENT)
    }

    /// Creates a file or directory `name` in `parent`.
    pub(crate) fn create(
        &mut self,
        parent: Ino,
        name: &OsStr,
        perm: u16,
        is_dir: bool,
    ) -> Result<Ino, Errno> {
        if self.dir(parent)?.entries.contains_key(name) {
            return Err(libc::EEXIST);
        }
        let node = if is_dir {
            new_dir(name.to_owned(), perm)
        } else {
            Node {
                body: Body::File(FileBody {
                    data: Vec::new(),
                    durable: Vec::new(),
                    dirty_from: None,
                }),
                perm,
                nlink: 1,
                name: name.to_owned(),
                mtime: SystemTime::now(),
            }
        };
        let ino = self.insert(node);
        self.dir_mut(parent)?.entries.insert(name.to_owned(), ino);
        self.stats.creates += 1;
        Ok(ino)
    }

    pub(crate) fn link(&mut self, ino: Ino, parent: Ino, name: &OsStr) -> Result<(), Errno> {
        if self.node(ino)?.is_dir() {
            return Err(libc::EPERM);
        }
        if self.dir(parent)?.entries.contains_key(name) {
            return Err(libc::EEXIST);
        }
        self.dir_mut(parent)?.entries.insert(name.to_owned(), ino);
        let node = self.node_mut(ino)?;
        node.nlink += 1;
        node.name = name.to_owned();
        self.stats.creates += 1;
        Ok(())
    }

    /// Removes the entry `name` (a directory only if `dir`, and only when it is empty).
    pub(crate) fn remove(&mut self, parent: Ino, name: &OsStr, dir: bool) -> Result<(), Errno> {
        let ino = self.lookup(parent, name)?;
        let node = self.node(ino)?;
        match (&node.body, dir) {
            (Body::Dir(body), true) if !body.entries.is_empty() => return Err(libc::ENOTEMPTY),
            (Body::Dir(_), false) => return Err(libc::EISDIR),
            (Body::File(_), true) => return Err(libc::ENOTDIR),
            _ => {}
        }
        self.dir_mut(parent)?.entries.remove(name);
        let node = self.node_mut(ino)?;
        node.nlink = node.nlink.saturating_sub(1);
        self.stats.removes += 1;
        Ok(())
    }

    pub(crate) fn rename(
        &mut self,
        parent: Ino,
        name: &OsStr,
        new_parent: Ino,
        new_name: &OsStr,
        no_replace: bool,
    ) -> Result<(), Errno> {
        let ino = self.lookup(parent, name)?;
        self.dir(new_parent)?;
        if let Ok(target) = self.lookup(new_parent, new_name) {
            if target == ino {
                return Ok(());
            }
            if no_replace {
                return Err(libc::EEXIST);
            }
            let source_is_dir = self.node(ino)?.is_dir();
            match &self.node(target)?.body {
                Body::Dir(_) if !source_is_dir => return Err(libc::EISDIR),
                Body::Dir(body) if !body.entries.is_empty() => return Err(libc::ENOTEMPTY),
                Body::File(_) if source_is_dir => return Err(libc::ENOTDIR),
                _ => {}
            }
            let replaced = self.node_mut(target)?;
            replaced.nlink = replaced.nlink.saturating_sub(1);
        }
        self.dir_mut(parent)?.entries.remove(name);
        self.dir_mut(new_parent)?
            .entries
            .insert(new_name.to_owned(), ino);
        self.node_mut(ino)?.name = new_name.to_owned();
        self.stats.renames += 1;
        Ok(())
    }

    pub(crate) fn read(&self, ino: Ino, offset: u64, size: u32) -> Result<&[u8], Errno> {
        match &self.node(ino)?.body {
            Body::File(file) => {
                let start = (offset as usize).min(file.data.len());
                let end = start.saturating_add(size as usize).min(file.data.len());
                Ok(&file.data[start..end])
            }
            Body::Dir(_) => Err(libc::EISDIR),
        }
    }

    pub(crate) fn write(&mut self, ino: Ino, offset: u64, bytes: &[u8]) -> Result<(), Errno> {
        let file = self.file_mut(ino)?;
        let start = usize::try_from(offset).map_err(|_| libc::EFBIG)?;
        let end = start.checked_add(bytes.len()).ok_or(libc::EFBIG)?;
        let old_len = file.data.len() as u64;
        if file.data.len() < end {
            file.data.resize(end, 0);
        }
        file.data[start..end].copy_from_slice(bytes);
        let from = offset.min(old_len);
        file.dirty_from = Some(file.dirty_from.map_or(from, |lowest| lowest.min(from)));
        self.node_mut(ino)?.mtime = SystemTime::now();
        self.last_write = Some((ino, offset, bytes.len() as u64));
        self.stats.writes += 1;
        self.stats.bytes_written += bytes.len() as u64;
        Ok(())
    }

    pub(crate) fn truncate(&mut self, ino: Ino, size: u64) -> Result<(), Errno> {
        let file = self.file_mut(ino)?;
        let new_len = usize::try_from(size).map_err(|_| libc::EFBIG)?;
        let from = size.min(file.data.len() as u64);
        file.data.resize(new_len, 0);
        file.dirty_from = Some(file.dirty_from.map_or(from, |lowest| lowest.min(from)));
        Ok(())
    }

    pub(crate) fn set_perm(&mut self, ino: Ino, perm: u16) -> Result<(), Errno> {
        self.node_mut(ino)?.perm = perm;
        Ok(())
    }

    /// `fsync`/`fdatasync` of a file, or `fsync` of a directory.
    pub(crate) fn sync(&mut self, ino: Ino) -> Result<(), Errno> {
        match &mut self.node_mut(ino)?.body {
            Body::File(file) => {
                if let Some(from) = file.dirty_from.take() {
                    let from = (from as usize).min(file.durable.len());
                    file.durable.truncate(from);
                    file.durable.extend_from_slice(&file.data[from..]);
                }
                self.stats.file_syncs += 1;
            }
            Body::Dir(dir) => {
                dir.durable = dir.entries.clone();
                self.stats.dir_syncs += 1;
            }
        }
        Ok(())
    }

    /// The entries of a directory as seen: (name, node, is a directory).
    pub(crate) fn entries(&self, ino: Ino) -> Result<Vec<(OsString, Ino, bool)>, Errno> {
        Ok(self
            .dir(ino)?
            .entries
            .iter()
            .map(|(name, &child)| {
                let is_dir = self.nodes.get(&child).is_some_and(Node::is_dir);
                (name.clone(), child, is_dir)
            })
            .collect())
    }

    /// Tears the latest write as a power cut in the middle of it would: the file's unsynced
    /// bytes up to a sector boundary inside that write reach the disk, the rest do not.
    /// `pick` chooses how many of the write's sectors survive (taken modulo their count, so
    /// at least its last sector is lost). Returns (file name, bytes kept of the write, its
    /// length), or `None` when the latest write was synced since.
    pub(crate) fn tear_last_write(&mut self, pick: u64) -> Option<(OsString, u64, u64)> {
        let (ino, offset, len) = self.last_write?;
        let node = self.nodes.get_mut(&ino)?;
        let Body::File(file) = &mut node.body else {
            return None;
        };
        file.dirty_from?;
        let first_sector = offset / SECTOR;
        let last_sector = (offset + len).div_ceil(SECTOR);
        let sectors = last_sector - first_sector;
        let end = ((first_sector + pick % sectors) * SECTOR)
            .max(offset)
            .min(file.data.len() as u64) as usize;
        // The disk wrote the file in order up to `end`, then lost power.
        let mut torn = file.data[..end].to_vec();
        if file.durable.len() > end {
            torn.extend_from_slice(&file.durable[end..]);
        }
        file.durable = torn;
        Some((node.name.clone(), end as u64 - offset, len))
    }

    /// Writes the tree in the chosen view into the empty directory `out`.
    pub(crate) fn write_out(&self, out: &Path, view: View) -> io::Result<()> {
        let mut written: HashMap<Ino, std::path::PathBuf> = HashMap::new();
        self.write_dir(ROOT, out, view, &mut written)
    }

    fn write_dir(
        &self,
        ino: Ino,
        out: &Path,
        view: View,
        written: &mut HashMap<Ino, std::path::PathBuf>,
    ) -> io::Result<()> {
        let Some(Node {
            body: Body::Dir(dir),
            ..
        }) = self.nodes.get(&ino)
        else {
            return Ok(());
        };
        let entries = match view {
            View::Current => &dir.entries,
            View::Durable => &dir.durable,
        };
        for (name, &child) in entries {
            let path = out.join(name);
            let Some(node) = self.nodes.get(&child) else {
                continue;
            };
            match &node.body {
                Body::Dir(_) => {
                    std::fs::create_dir(&path)?;
                    self.write_dir(child, &path, view, written)?;
                }
                Body::File(file) => {
                    if let Some(first) = written.get(&child) {
                        std::fs::hard_link(first, &path)?;
                        continue;
                    }
                    let bytes = match view {
                        View::Current => &file.data,
                        View::Durable => &file.durable,
                    };
                    std::fs::write(&path, bytes)?;
                    written.insert(child, path.clone());
                }
            }
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(u32::from(node.perm)))?;
        }
        Ok(())
    }
}

fn new_dir(name: OsString, perm: u16) -> Node {
    Node {
        body: Body::Dir(DirBody {
            entries: BTreeMap::new(),
            durable: BTreeMap::new(),
        }),
        perm,
        nlink: 1,
        name,
        mtime: SystemTime::now(),
    }
}
