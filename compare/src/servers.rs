//! Redis and PostgreSQL servers the harness starts for itself: on 127.0.0.1 only, on
//! non-default ports, with data under the run's temporary directory, and stopped by pid when the
//! run ends (also on an error, through `Drop`).

use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// A server process this harness started; stopped with SIGTERM (PostgreSQL: SIGINT, its fast
/// shutdown) when dropped.
pub struct Server {
    name: &'static str,
    child: Child,
    stop_signal: i32,
}

impl Drop for Server {
    fn drop(&mut self) {
        let pid = self.child.id() as i32;
        // SAFETY: signalling a child we spawned and have not reaped, so the pid is still ours.
        unsafe {
            libc::kill(pid, self.stop_signal);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("{} (pid {pid}) did not stop in 20 s; killing it", self.name);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Makes the server receive `signal` when the harness dies, however it dies (an interrupted run
/// must not leave servers behind). Set in the child after its user change, so it survives exec.
fn stop_with_parent(command: &mut Command, signal: i32) {
    // SAFETY: prctl is async-signal-safe; the closure allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Starts `redis-server` on 127.0.0.1:`port`: without persistence, or with an append-only file
/// fsynced before every reply (`appendfsync always`).
pub fn redis(dir: &Path, port: u16, fsync_always: bool) -> Result<Server> {
    ensure_free(port)?;
    let data = dir.join(format!("redis-{port}"));
    std::fs::create_dir_all(&data)?;
    let mut command = Command::new("redis-server");
    command.args(["--bind", "127.0.0.1", "--port", &port.to_string()]);
    command.args(["--save", "", "--daemonize", "no", "--protected-mode", "yes"]);
    command.arg("--dir").arg(&data);
    if fsync_always {
        command.args(["--appendonly", "yes", "--appendfsync", "always"]);
    } else {
        command.args(["--appendonly", "no"]);
    }
    command.args(["--maxclients", "1000"]);
    stop_with_parent(&mut command, libc::SIGTERM);
    let child = command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting redis-server (scripts/compare.sh installs it)")?;
    let server = Server {
        name: "redis-server",
        child,
        stop_signal: libc::SIGTERM,
    };
    wait_for_port(port)?;
    Ok(server)
}

/// Initialises a PostgreSQL cluster under `dir` and starts it on 127.0.0.1:`port`.
///
/// `initdb` and `postgres` refuse to run as root; when root, both run as the `postgres` system
/// user (created by Debian's package), which then owns the cluster directory.
pub fn postgres(dir: &Path, port: u16) -> Result<Server> {
    postgres_with(dir, port, &[])
}

/// [`postgres`] with more settings (`name=value`, each passed as `-c`).
pub fn postgres_with(dir: &Path, port: u16, settings: &[&str]) -> Result<Server> {
    ensure_free(port)?;
    let bin = postgres_bin()?;
    let data = dir.join("postgres");
    std::fs::create_dir_all(&data)?;
    let user = if unsafe { libc::geteuid() } == 0 {
        let (uid, gid) = system_user("postgres")?;
        // The cluster directory, and the way to it, must be the server user's.
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))?;
        std::os::unix::fs::chown(&data, Some(uid), Some(gid))?;
        Some((uid, gid))
    } else {
        None
    };
    let as_server_user = |command: &mut Command| {
        if let Some((uid, gid)) = user {
            command.uid(uid).gid(gid);
        }
    };

    let mut initdb = Command::new(bin.join("initdb"));
    initdb
        .arg("-D")
        .arg(&data)
        .args(["--auth=trust", "--username=postgres", "--encoding=UTF8"]);
    as_server_user(&mut initdb);
    let output = initdb.output().context("running initdb")?;
    if !output.status.success() {
        bail!("initdb failed: {}", String::from_utf8_lossy(&output.stderr));
    }

    let mut command = Command::new(bin.join("postgres"));
    command.arg("-D").arg(&data);
    command.args(["-p", &port.to_string()]);
    command.args(["-c", "listen_addresses=127.0.0.1"]);
    command
        .arg("-c")
        .arg(format!("unix_socket_directories={}", data.display()));
    // Durable by default (fsync on, synchronous_commit on); sessions relax it where a run says.
    command.args(["-c", "fsync=on", "-c", "max_connections=200"]);
    command.args(["-c", "shared_buffers=512MB", "-c", "max_wal_size=4GB"]);
    for setting in settings {
        command.args(["-c", setting]);
    }
    as_server_user(&mut command);
    stop_with_parent(&mut command, libc::SIGINT);
    let log = std::fs::File::create(dir.join("postgres.log"))?;
    let child = command
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("starting postgres")?;
    let server = Server {
        name: "postgres",
        child,
        stop_signal: libc::SIGINT,
    };
    wait_for_port(port)?;
    // The port opens a moment before the server accepts sessions.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match postgres::Client::connect(&postgres_url(port), postgres::NoTls) {
            Ok(_) => break,
            Err(error) if Instant::now() > deadline => return Err(error.into()),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    Ok(server)
}

pub fn postgres_url(port: u16) -> String {
    format!("host=127.0.0.1 port={port} user=postgres dbname=postgres")
}

fn postgres_bin() -> Result<PathBuf> {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<PathBuf> = std::fs::read_dir(root)
        .context("PostgreSQL server not installed (scripts/compare.sh installs it)")?
        .filter_map(|entry| entry.ok().map(|entry| entry.path().join("bin")))
        .filter(|bin| bin.join("postgres").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .context("no PostgreSQL server binary under /usr/lib/postgresql")
}

fn system_user(name: &str) -> Result<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    for line in passwd.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() > 3 && fields[0] == name {
            return Ok((fields[2].parse()?, fields[3].parse()?));
        }
    }
    bail!("no system user {name:?}");
}

/// Refuses a port something else already listens on: the harness must talk to its own server.
pub fn ensure_free(port: u16) -> Result<()> {
    if TcpStream::connect(("127.0.0.1", port)).is_ok() {
        bail!("127.0.0.1:{port} is already in use; pick other ports with --base-port");
    }
    Ok(())
}

fn wait_for_port(port: u16) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("nothing listens on 127.0.0.1:{port} after 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}
