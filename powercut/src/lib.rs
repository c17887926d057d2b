//! A FUSE file system for tests that loses, when told the power went out, every write that was
//! not made durable: file bytes not covered by an `fsync`/`fdatasync` of that file, and
//! directory entries (creates, renames, removals) not covered by an `fsync` of their directory.
//!
//! A killed process cannot test durability: the operating system keeps its page cache, so a
//! program that never syncs survives a SIGKILL intact. This file system holds what the programs
//! wrote in its own memory instead, and on [`PowerCut::power_off`] writes only the durable state
//! back to its backing directory. The rules are in `model.rs`; they are strict POSIX.
//!
//! Usage: [`PowerCut::mount`] a backing directory (its contents are taken as durable) on a
//! mount point; run the program under test on the mount point, best in a child process; cut the
//! power with [`PowerCut::cut`] or at an operation with [`PowerCut::arm`] (after the cut every
//! request fails with EIO); kill the program; [`PowerCut::power_off`] unmounts and leaves the
//! durable state in the backing directory, where the next run starts from.
//!
//! Mounting needs root (or `fusermount3`) and the kernel's `fuse` file system; `mount` returns
//! the error when either is missing, so that tests can skip.

mod model;

use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, LockOwner, OpenFlags,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};

use model::{Ino, Model, View};
pub use model::{SECTOR, Stats};

/// How long the kernel may cache names and attributes. Only the program under test changes the
/// file system, and only through the kernel, so its caches stay true.
const TTL: Duration = Duration::from_secs(1);

/// An operation that starts the countdown of an armed cut.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A file or directory is created (or linked) whose name contains this string: a program
    /// marks the start of a phase by creating such a file; `.log` catches a new RocksDB WAL.
    Create(String),
    /// A rename whose old and new names both end with this suffix (RocksDB reusing an old WAL
    /// file under a new number: `.log`).
    Rename(String),
    /// A write to a file whose name ends with this suffix.
    Write(String),
    /// A file removed (unlinked) whose name contains this string: a program giving back
    /// files it no longer needs.
    Remove(String),
}

/// What [`PowerCut::power_off`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CutReport {
    /// The torn write, if one was torn: (file name, bytes of it kept, its length).
    pub torn: Option<(String, u64, u64)>,
    /// What the programs asked of the file system while it was mounted.
    pub stats: Stats,
}

struct Armed {
    event: Event,
    /// Mutating operations still allowed once the event was seen (`None`: not seen yet).
    left: Option<u32>,
    ops: u32,
}

struct State {
    model: Model,
    cut: bool,
    armed: Option<Armed>,
}

struct Shared {
    state: Mutex<State>,
    cut_signal: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic in a request handler must not hide the state from the test.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A mounted power-cut file system. Dropping it without [`PowerCut::power_off`] or
/// [`PowerCut::unmount`] detaches the mount and leaves the backing directory as it was.
pub struct PowerCut {
    session: Option<fuser::BackgroundSession>,
    shared: Arc<Shared>,
    backing: PathBuf,
    mountpoint: PathBuf,
}

impl PowerCut {
    /// Mounts the tree in `backing` (all of it durable) on the existing, empty directory
    /// `mountpoint`.
    ///
    /// # Errors
    /// When `backing` cannot be read (or holds anything but files and directories), or when
    /// the mount is refused (no FUSE in the kernel, no permission).
    pub fn mount(backing: impl AsRef<Path>, mountpoint: impl AsRef<Path>) -> io::Result<PowerCut> {
        let backing = backing.as_ref().to_path_buf();
        let mountpoint = mountpoint.as_ref().to_path_buf();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                model: Model::load(&backing)?,
                cut: false,
                armed: None,
            }),
            cut_signal: Condvar::new(),
        });
        let mut config = fuser::Config::default();
        config.mount_options = vec![fuser::MountOption::FSName("idemdb-powercut".into())];
        let session = fuser::spawn_mount(
            Fs {
                shared: shared.clone(),
            },
            &mountpoint,
            &config,
        )?;
        Ok(PowerCut {
            session: Some(session),
            shared,
            backing,
            mountpoint,
        })
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// Cuts the power now: every later request fails with EIO, and what is durable now is what
    /// [`PowerCut::power_off`] keeps.
    pub fn cut(&self) {
        let mut state = self.shared.lock();
        state.cut = true;
        self.shared.cut_signal.notify_all();
    }

    /// Whether the power is cut.
    pub fn is_cut(&self) -> bool {
        self.shared.lock().cut
    }

    /// Waits up to `timeout` for the power to be cut (by [`PowerCut::arm`]); returns whether it
    /// is.
    pub fn wait_cut(&self, timeout: Duration) -> bool {
        let state = self.shared.lock();
        let (state, _) = self
            .shared
            .cut_signal
            .wait_timeout_while(state, timeout, |state| !state.cut)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        state.cut
    }

    /// Arms a cut: once an operation matches `event`, that operation and the mutating ones
    /// after it (writes, syncs, creates, links, removals, renames, truncations) proceed until
    /// `ops` of them have; the next one finds the power cut. With `ops` 0 the matching operation
    /// itself is refused. Replaces an earlier armed cut.
    pub fn arm(&self, event: Event, ops: u32) {
        self.shared.lock().armed = Some(Armed {
            event,
            left: None,
            ops,
        });
    }

    /// What the programs asked so far.
    pub fn stats(&self) -> Stats {
        self.shared.lock().model.stats
    }

    /// Cuts the power (if not cut yet), unmounts, and replaces the backing directory's contents
    /// by the durable state. With `tear`, the latest write, if it is not synced, is torn at a
    /// sector boundary chosen by the value (see [`SECTOR`]) instead of being lost whole.
    ///
    /// Every program using the mount should be gone first (killed): an open file keeps the
    /// mount busy, and then it is detached lazily.
    ///
    /// # Errors
    /// When the backing directory cannot be rewritten.
    pub fn power_off(mut self, tear: Option<u64>) -> io::Result<CutReport> {
        self.cut();
        self.detach();
        let mut state = self.shared.lock();
        let torn = tear
            .and_then(|pick| state.model.tear_last_write(pick))
            .map(|(name, kept, len)| (name.to_string_lossy().into_owned(), kept, len));
        replace_contents(&self.backing, &state.model, View::Durable)?;
        Ok(CutReport {
            torn,
            stats: state.model.stats,
        })
    }

    /// Unmounts cleanly: the backing directory gets everything written, synced or not (an
    /// orderly shutdown, which writes the page cache back).
    ///
    /// # Errors
    /// When the backing directory cannot be rewritten.
    pub fn unmount(mut self) -> io::Result<Stats> {
        self.detach();
        let state = self.shared.lock();
        replace_contents(&self.backing, &state.model, View::Current)?;
        Ok(state.model.stats)
    }

    /// Unmounts; lazily when the mount is still busy.
    fn detach(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        if session.umount_and_join().is_err() {
            lazy_unmount(&self.mountpoint);
        }
    }
}

impl Drop for PowerCut {
    fn drop(&mut self) {
        if self.session.is_some() {
            self.cut();
            self.detach();
        }
    }
}

fn lazy_unmount(mountpoint: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(mountpoint.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: `path` is a valid NUL-terminated string for the duration of the call.
    unsafe {
        libc::umount2(path.as_ptr(), libc::MNT_DETACH);
    }
}

/// Empties `backing` and writes the model's `view` into it.
fn replace_contents(backing: &Path, model: &Model, view: View) -> io::Result<()> {
    for entry in std::fs::read_dir(backing)? {
        let path = entry?.path();
        if path.symlink_metadata()?.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
    }
    model.write_out(backing, view)
}

/// The request handlers: each takes the state's lock, refuses everything once the power is
/// cut, and counts mutating requests towards an armed cut.
struct Fs {
    shared: Arc<Shared>,
}

/// A mutating request, as an armed cut matches it.
enum Op<'a> {
    Create(&'a OsStr),
    Rename(&'a OsStr, &'a OsStr),
    Write(Ino),
    Remove(&'a OsStr),
    Other,
}

impl Fs {
    /// Takes the lock for a request that changes nothing; `None` once the power is cut.
    fn reading(&self) -> Option<MutexGuard<'_, State>> {
        let state = self.shared.lock();
        (!state.cut).then_some(state)
    }

    /// Takes the lock for a mutating request; `None` once the power is cut, including by this
    /// very request through an armed cut.
    fn mutating(&self, op: Op<'_>) -> Option<MutexGuard<'_, State>> {
        let mut state = self.shared.lock();
        if state.cut {
            return None;
        }
        let matched = match (&state.armed, &op) {
            (
                Some(Armed {
                    left: None, event, ..
                }),
                op,
            ) => match (event, op) {
                (Event::Create(part), Op::Create(name)) => {
                    name.to_string_lossy().contains(part.as_str())
                }
                (Event::Rename(suffix), Op::Rename(from, to)) => {
                    from.to_string_lossy().ends_with(suffix.as_str())
                        && to.to_string_lossy().ends_with(suffix.as_str())
                }
                (Event::Remove(part), Op::Remove(name)) => {
                    name.to_string_lossy().contains(part.as_str())
                }
                (Event::Write(suffix), Op::Write(ino)) => state
                    .model
                    .node(*ino)
                    .is_ok_and(|node| node.name.to_string_lossy().ends_with(suffix.as_str())),
                _ => false,
            },
            _ => false,
        };
        if let Some(armed) = &mut state.armed {
            if matched {
                armed.left = Some(armed.ops);
            }
            if let Some(left) = &mut armed.left {
                if *left == 0 {
                    state.cut = true;
                    state.armed = None;
                    self.shared.cut_signal.notify_all();
                    return None;
                }
                *left -= 1;
            }
        }
        Some(state)
    }
}

/// The permission bits a new file gets: its mode less the caller's umask.
fn permissions(mode: u32, umask: u32) -> u16 {
    (mode & !umask & 0o7777) as u16
}

fn errno(code: i32) -> Errno {
    Errno::from_i32(code)
}

fn attr(model: &Model, ino: Ino) -> Result<FileAttr, i32> {
    let node = model.node(ino)?;
    let size = node.size();
    Ok(FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size.div_ceil(512),
        atime: node.mtime,
        mtime: node.mtime,
        ctime: node.mtime,
        crtime: SystemTime::UNIX_EPOCH,
        kind: if node.is_dir() {
            FileType::Directory
        } else {
            FileType::RegularFile
        },
        perm: node.perm,
        nlink: node.nlink.max(1),
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    })
}

fn reply_entry(state: &State, ino: Result<Ino, i32>, reply: ReplyEntry) {
    match ino.and_then(|ino| attr(&state.model, ino)) {
        Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
        Err(code) => reply.error(errno(code)),
    }
}

fn reply_empty(result: Result<(), i32>, reply: ReplyEmpty) {
    match result {
        Ok(()) => reply.ok(),
        Err(code) => reply.error(errno(code)),
    }
}

impl fuser::Filesystem for Fs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(state) = self.reading() else {
            return reply.error(Errno::EIO);
        };
        let ino = state.model.lookup(parent.0, name);
        reply_entry(&state, ino, reply);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let Some(state) = self.reading() else {
            return reply.error(Errno::EIO);
        };
        match attr(&state.model, ino.0) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(code) => reply.error(errno(code)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let state = if size.is_some() {
            self.mutating(Op::Other)
        } else {
            self.reading()
        };
        let Some(mut state) = state else {
            return reply.error(Errno::EIO);
        };
        let mut result = Ok(());
        if let Some(size) = size {
            result = state.model.truncate(ino.0, size);
        }
        if let (Ok(()), Some(mode)) = (result, mode) {
            result = state.model.set_perm(ino.0, (mode & 0o7777) as u16);
        }
        match result.and_then(|()| attr(&state.model, ino.0)) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(code) => reply.error(errno(code)),
        }
    }

    fn mknod(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            return reply.error(Errno::EPERM);
        }
        let Some(mut state) = self.mutating(Op::Create(name)) else {
            return reply.error(Errno::EIO);
        };
        let perm = permissions(mode, umask);
        let ino = state.model.create(parent.0, name, perm, false);
        reply_entry(&state, ino, reply);
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let Some(mut state) = self.mutating(Op::Create(name)) else {
            return reply.error(Errno::EIO);
        };
        let perm = permissions(mode, umask);
        let ino = state.model.create(parent.0, name, perm, true);
        reply_entry(&state, ino, reply);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let Some(mut state) = self.mutating(Op::Remove(name)) else {
            return reply.error(Errno::EIO);
        };
        reply_empty(state.model.remove(parent.0, name, false), reply);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let Some(mut state) = self.mutating(Op::Other) else {
            return reply.error(Errno::EIO);
        };
        reply_empty(state.model.remove(parent.0, name, true), reply);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if flags.contains(RenameFlags::RENAME_EXCHANGE)
            || flags.contains(RenameFlags::RENAME_WHITEOUT)
        {
            return reply.error(Errno::EINVAL);
        }
        let Some(mut state) = self.mutating(Op::Rename(name, newname)) else {
            return reply.error(Errno::EIO);
        };
        let no_replace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        reply_empty(
            state
                .model
                .rename(parent.0, name, newparent.0, newname, no_replace),
            reply,
        );
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let Some(mut state) = self.mutating(Op::Create(newname)) else {
            return reply.error(Errno::EIO);
        };
        let linked = state
            .model
            .link(ino.0, newparent.0, newname)
            .map(|()| ino.0);
        reply_entry(&state, linked, reply);
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.0 & libc::O_TRUNC != 0 {
            let Some(mut state) = self.mutating(Op::Other) else {
                return reply.error(Errno::EIO);
            };
            if let Err(code) = state.model.truncate(ino.0, 0) {
                return reply.error(errno(code));
            }
        } else if self.reading().is_none() {
            return reply.error(Errno::EIO);
        }
        reply.opened(FileHandle(0), FopenFlags::empty());
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(state) = self.reading() else {
            return reply.error(Errno::EIO);
        };
        match state.model.read(ino.0, offset, size) {
            Ok(bytes) => reply.data(bytes),
            Err(code) => reply.error(errno(code)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Some(mut state) = self.mutating(Op::Write(ino.0)) else {
            return reply.error(Errno::EIO);
        };
        match state.model.write(ino.0, offset, data) {
            Ok(()) => reply.written(data.len() as u32),
            Err(code) => reply.error(errno(code)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2): nothing becomes durable.
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let Some(mut state) = self.mutating(Op::Other) else {
            return reply.error(Errno::EIO);
        };
        reply_empty(state.model.sync(ino.0), reply);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let Some(state) = self.reading() else {
            return reply.error(Errno::EIO);
        };
        let entries = match state.model.entries(ino.0) {
            Ok(entries) => entries,
            Err(code) => return reply.error(errno(code)),
        };
        let dots = [
            (OsStr::new(".").to_owned(), ino.0, true),
            (OsStr::new("..").to_owned(), ino.0, true),
        ];
        for (index, (name, child, is_dir)) in dots
            .into_iter()
            .chain(entries)
            .enumerate()
            .skip(offset as usize)
        {
            let kind = if is_dir {
                FileType::Directory
            } else {
                FileType::RegularFile
            };
            if reply.add(INodeNo(child), index as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let Some(mut state) = self.mutating(Op::Other) else {
            return reply.error(Errno::EIO);
        };
        reply_empty(state.model.sync(ino.0), reply);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // Plenty of room: RocksDB looks at the free space only to recover from a full disk.
        let blocks = 1 << 24;
        reply.statfs(blocks, blocks, blocks, 1 << 20, 1 << 20, 4096, 255, 4096);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.ok();
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let Some(mut state) = self.mutating(Op::Create(name)) else {
            return reply.error(Errno::EIO);
        };
        let perm = permissions(mode, umask);
        match state
            .model
            .create(parent.0, name, perm, false)
            .and_then(|ino| attr(&state.model, ino))
        {
            Ok(attr) => reply.created(
                &TTL,
                &attr,
                Generation(0),
                FileHandle(0),
                FopenFlags::empty(),
            ),
            Err(code) => reply.error(errno(code)),
        }
    }
}
