//! The consumer processes of a run, one per slot (a shard, a stream, a fleet member): started
//! from a recipe's binary with the command line the checker builds for the slot, its output
//! appended to `consumer-<slot>.log` in the work folder, SIGKILLed, paused, restarted when it
//! died, and stopped at the end. Every process still running is SIGKILLed when the supervisor is
//! dropped, and every process gets SIGKILL if the checker dies: a failing run leaves nothing
//! behind.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::BoxError;

/// Builds slot `slot`'s command line (the arguments after the binary).
pub type CommandLine = Box<dyn FnMut(usize, &mut Command) -> Result<(), BoxError> + Send>;

pub struct Supervisor {
    binary: PathBuf,
    work: PathBuf,
    command_line: CommandLine,
    slots: Vec<Option<Child>>,
    /// Processes started, restarts included.
    pub starts: u64,
    /// Processes that died of SIGKILL on their own (at a crash point, on purpose).
    pub self_kills: u64,
    /// Processes that exited any other way: a bug even when nothing was lost.
    pub unexpected_exits: u64,
}

/// The binary of the recipe `name` (`examples/<name>.rs`), which Cargo puts in `examples/`
/// beside the checkers' own binaries.
pub fn recipe(name: &str) -> Result<PathBuf, BoxError> {
    let binary = std::env::current_exe()?
        .with_file_name("examples")
        .join(name);
    if !binary.exists() {
        return Err(format!(
            "{} not found: build it with `cargo build --release --all-features --example {name}`",
            binary.display()
        )
        .into());
    }
    Ok(binary)
}

/// Makes the process `command` starts get SIGKILL when the checker dies, however it dies: a
/// failing run leaves nothing behind.
pub fn die_with_parent(command: &mut Command) {
    // SAFETY: prctl is async-signal-safe and touches only the child's own state.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

impl Supervisor {
    /// `slots` processes of `binary`, none started yet.
    pub fn new(binary: PathBuf, work: &Path, slots: usize, command_line: CommandLine) -> Self {
        Supervisor {
            binary,
            work: work.to_owned(),
            command_line,
            slots: (0..slots).map(|_| None).collect(),
            starts: 0,
            self_kills: 0,
            unexpected_exits: 0,
        }
    }

    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Starts the process of `slot` (which must have none running).
    pub fn start(&mut self, slot: usize) -> Result<(), BoxError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.work.join(format!("consumer-{slot}.log")))?;
        let mut command = Command::new(&self.binary);
        (self.command_line)(slot, &mut command)?;
        command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        die_with_parent(&mut command);
        self.slots[slot] = Some(command.spawn()?);
        self.starts += 1;
        Ok(())
    }

    pub fn start_all(&mut self) -> Result<(), BoxError> {
        (0..self.slots.len()).try_for_each(|slot| self.start(slot))
    }

    pub fn pid(&self, slot: usize) -> Option<u32> {
        self.slots[slot].as_ref().map(Child::id)
    }

    /// Whether a process runs in `slot` (one that has exited is left for
    /// [`Supervisor::restart_exited`]).
    pub fn running(&mut self, slot: usize) -> Result<bool, BoxError> {
        match &mut self.slots[slot] {
            Some(child) => Ok(child.try_wait()?.is_none()),
            None => Ok(false),
        }
    }

    /// SIGKILLs the process in `slot` and returns its pid; `None` if it had exited already
    /// (it is then left for [`Supervisor::restart_exited`], and no kill is counted).
    pub fn kill(&mut self, slot: usize) -> Result<Option<u32>, BoxError> {
        let Some(child) = &mut self.slots[slot] else {
            return Ok(None);
        };
        if child.try_wait()?.is_some() {
            return Ok(None);
        }
        let pid = child.id();
        child.kill()?; // SIGKILL
        child.wait()?;
        self.slots[slot] = None;
        Ok(Some(pid))
    }

    /// SIGKILLs the process in `slot` and starts another; its pid, `None` (and nothing done) if
    /// it had exited already.
    pub fn kill_and_restart(&mut self, slot: usize) -> Result<Option<u32>, BoxError> {
        let killed = self.kill(slot)?;
        if killed.is_some() {
            self.start(slot)?;
        }
        Ok(killed)
    }

    /// Sends `signal` (SIGSTOP, SIGCONT, ...) to the process in `slot`, if one runs there.
    pub fn signal(&self, slot: usize, signal: libc::c_int) -> Result<Option<u32>, BoxError> {
        let Some(child) = &self.slots[slot] else {
            return Ok(None);
        };
        let pid = libc::pid_t::try_from(child.id())?;
        // SAFETY: signalling a child of ours by its pid; it has not been waited for yet.
        unsafe { libc::kill(pid, signal) };
        Ok(Some(child.id()))
    }

    /// Starts again every slot whose process has exited (reaped and counted here) or was never
    /// started.
    pub fn restart_exited(&mut self) -> Result<(), BoxError> {
        for slot in 0..self.slots.len() {
            if let Some(running) = &mut self.slots[slot] {
                let Some(status) = running.try_wait()? else {
                    continue;
                };
                if status.signal() == Some(libc::SIGKILL) {
                    self.self_kills += 1;
                } else {
                    self.unexpected_exits += 1;
                    eprintln!("checker: consumer {slot} exited with {status}; restarting");
                }
                self.slots[slot] = None;
            }
            self.start(slot)?;
        }
        Ok(())
    }

    /// SIGTERM to every process, then waits: they finish what is in flight and exit. One that
    /// has not stopped within a minute is stuck: it is SIGKILLed and counted unexpected, so a
    /// hang fails the run instead of stalling it.
    pub fn stop_gracefully(&mut self) -> Result<(), BoxError> {
        for slot in 0..self.slots.len() {
            self.signal(slot, libc::SIGTERM)?;
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        for slot in 0..self.slots.len() {
            let Some(mut child) = self.slots[slot].take() else {
                continue;
            };
            let status = loop {
                if let Some(status) = child.try_wait()? {
                    break status;
                }
                if Instant::now() > deadline {
                    eprintln!("checker: a consumer did not stop within a minute; SIGKILL");
                    self.unexpected_exits += 1;
                    child.kill()?;
                    break child.wait()?;
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            if status.signal() == Some(libc::SIGKILL) {
                self.self_kills += 1;
            } else if !status.success() {
                eprintln!("checker: a consumer stopped with {status}");
                self.unexpected_exits += 1;
            }
        }
        Ok(())
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        for child in self.slots.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
