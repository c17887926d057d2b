//! A tmpfs of a fixed size, mounted for one test and unmounted when dropped, whatever the test
//! did. Shared by the test binaries that need a small or separate file system (`#[path]`).

use std::path::Path;
use std::process::{Command, Stdio};

pub struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// `None` where mounting is refused (not root, or no mount permission in a container):
    /// the caller skips, saying why.
    pub fn mount(megabytes: u32) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={megabytes}m"), "tmpfs"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        mounted.then_some(Tmpfs { dir })
    }

    /// Grows or shrinks the file system in place (its files stay).
    #[allow(dead_code)] // not every test binary resizes
    pub fn resize(&self, megabytes: u32) {
        let status = Command::new("mount")
            .args(["-o", &format!("remount,size={megabytes}m")])
            .arg(self.dir.path())
            .status()
            .unwrap();
        assert!(status.success(), "remounting the test tmpfs");
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The bytes free for files, as `df` reports them.
    #[allow(dead_code)] // not every test binary asks
    pub fn free_bytes(&self) -> u64 {
        let output = Command::new("df")
            .args(["--output=avail", "-B1"])
            .arg(self.dir.path())
            .output()
            .unwrap();
        let text = String::from_utf8(output.stdout).unwrap();
        text.lines().nth(1).unwrap().trim().parse().unwrap()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let unmounted = Command::new("umount").arg(self.dir.path()).status();
        if !unmounted.is_ok_and(|status| status.success()) {
            // Lazily, so that the temporary directory can go even if something holds a file.
            let lazily = Command::new("umount")
                .arg("-l")
                .arg(self.dir.path())
                .status();
            if !lazily.is_ok_and(|status| status.success()) {
                eprintln!("could not unmount the test tmpfs at {:?}", self.dir.path());
            }
        }
    }
}
