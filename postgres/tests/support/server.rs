//! A private PostgreSQL server for one test run: its own data directory in a temporary
//! directory, 127.0.0.1 only, a free port, stopped by pid (SIGINT, a fast shutdown) when
//! dropped, and by the kernel if the test process dies first. It can be restarted on the same
//! port and data directory, after a fast shutdown or a crash (SIGKILL of every process).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Server {
    child: Child,
    pub port: u16,
    dir: tempfile::TempDir,
    bin: PathBuf,
    user: Option<(u32, u32)>,
}

/// How [`Server::restart`] stops the server.
#[allow(dead_code)] // each test binary uses what it needs
#[derive(Clone, Copy, Debug)]
pub enum Stop {
    /// SIGINT to the postmaster: open sessions are terminated (`admin_shutdown`), a
    /// checkpoint is written.
    Fast,
    /// SIGKILL to the postmaster and every process it started: no checkpoint, the next start
    /// runs crash recovery from the WAL.
    Crash,
}

impl Server {
    /// Starts a server, or says why it cannot (no PostgreSQL installed, say).
    pub fn start() -> Result<Server, String> {
        let bin = binaries()?;
        let dir = tempfile::Builder::new()
            .prefix("idemdb-pg-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        let data = dir.path().join("data");
        std::fs::create_dir(&data).map_err(|e| e.to_string())?;
        // As root, the server runs as the postgres user, which must own the way to its data.
        let user = if unsafe { libc::geteuid() } == 0 {
            let (uid, gid) = system_user("postgres")?;
            for path in [dir.path(), &data] {
                std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(|e| e.to_string())?;
            }
            Some((uid, gid))
        } else {
            None
        };
        let mut initdb = Command::new(bin.join("initdb"));
        initdb.arg("-D").arg(&data).args([
            "--auth=trust",
            "--username=postgres",
            "--encoding=UTF8",
        ]);
        as_user(&mut initdb, user);
        let output = initdb.output().map_err(|e| format!("initdb: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let port = free_port()?;
        std::fs::File::create(dir.path().join("postgres.log")).map_err(|e| e.to_string())?;
        let child = spawn_postgres(&bin, &data, port, user, &dir.path().join("postgres.log"))?;
        let server = Server {
            child,
            port,
            dir,
            bin,
            user,
        };
        server.wait_ready()?;
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres connect_timeout=5",
            self.port
        )
    }

    pub fn log(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    /// The postmaster's pid.
    #[allow(dead_code)]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Stops the server as `how` says and starts it again on the same port and data
    /// directory; returns once it accepts connections. Call it from the thread that started
    /// the server (the new postmaster is stopped by the kernel when that thread ends); it
    /// blocks that thread, so the connections' tasks must run on other threads.
    #[allow(dead_code)]
    pub fn restart(&mut self, how: Stop) -> Result<(), String> {
        let postmaster = self.child.id() as i32;
        match how {
            Stop::Fast => unsafe {
                libc::kill(postmaster, libc::SIGINT);
            },
            Stop::Crash => {
                // Its children first listed, then all killed: the postmaster first, so that it
                // starts none again.
                let children = children_of(postmaster);
                unsafe {
                    libc::kill(postmaster, libc::SIGKILL);
                }
                for pid in &children {
                    unsafe {
                        libc::kill(*pid, libc::SIGKILL);
                    }
                }
                // A new postmaster refuses to start while any old process holds the shared
                // memory.
                let deadline = Instant::now() + Duration::from_secs(30);
                while children.iter().any(|pid| alive(*pid)) {
                    if Instant::now() > deadline {
                        return Err("the killed server processes did not exit".to_owned());
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        self.child.wait().map_err(|e| e.to_string())?;
        let data = self.dir.path().join("data");
        self.child = spawn_postgres(&self.bin, &data, self.port, self.user, &self.log())?;
        // The wait connects with a runtime of its own, which cannot run inside the caller's.
        std::thread::scope(|scope| {
            scope
                .spawn(|| self.wait_ready())
                .join()
                .unwrap_or_else(|_| Err("wait_ready panicked".to_owned()))
        })
    }

    fn wait_ready(&self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        loop {
            let connected = runtime.block_on(async {
                tokio_postgres::connect(&self.url(), tokio_postgres::NoTls)
                    .await
                    .map(|_| ())
            });
            match connected {
                Ok(()) => return Ok(()),
                Err(error) if Instant::now() > deadline => {
                    return Err(format!(
                        "postgres did not accept connections: {error}; log: {}",
                        std::fs::read_to_string(self.log()).unwrap_or_default()
                    ));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGINT);
        }
        let _ = self.child.wait();
    }
}

fn as_user(command: &mut Command, user: Option<(u32, u32)>) {
    if let Some((uid, gid)) = user {
        command.uid(uid).gid(gid);
    }
}

/// Starts the postmaster on `data`, its log appended to `log`.
fn spawn_postgres(
    bin: &Path,
    data: &Path,
    port: u16,
    user: Option<(u32, u32)>,
    log: &Path,
) -> Result<Child, String> {
    let mut command = Command::new(bin.join("postgres"));
    command
        .arg("-D")
        .arg(data)
        .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1"])
        .arg("-c")
        .arg(format!("unix_socket_directories={}", data.display()))
        .args(["-c", "max_connections=100", "-c", "fsync=on"]);
    as_user(&mut command, user);
    // SAFETY: prctl is async-signal-safe; the closure touches nothing else.
    unsafe {
        command.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGINT);
            Ok(())
        });
    }
    let log = std::fs::OpenOptions::new()
        .append(true)
        .open(log)
        .map_err(|e| e.to_string())?;
    command
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("starting postgres: {e}"))
}

/// The processes whose parent is `parent`, from /proc.
fn children_of(parent: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| stat_of(*pid).is_some_and(|(_, ppid)| ppid == parent))
        .collect()
}

/// A process's state letter and parent pid, from /proc/<pid>/stat.
fn stat_of(pid: i32) -> Option<(char, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name, in parentheses, may hold spaces: the fields after its last ')' are plain.
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

/// Whether `pid` still runs (a zombie does not: it holds no memory).
fn alive(pid: i32) -> bool {
    stat_of(pid).is_some_and(|(state, _)| state != 'Z' && state != 'X')
}

fn binaries() -> Result<PathBuf, String> {
    let root = Path::new("/usr/lib/postgresql");
    let mut found: Vec<PathBuf> = std::fs::read_dir(root)
        .map_err(|_| "PostgreSQL is not installed (apt-get install postgresql)".to_owned())?
        .filter_map(|entry| entry.ok().map(|entry| entry.path().join("bin")))
        .filter(|bin| bin.join("postgres").exists())
        .collect();
    found.sort();
    found
        .pop()
        .ok_or_else(|| "no PostgreSQL server under /usr/lib/postgresql".to_owned())
}

fn system_user(name: &str) -> Result<(u32, u32), String> {
    let passwd = std::fs::read_to_string("/etc/passwd").map_err(|e| e.to_string())?;
    passwd
        .lines()
        .map(|line| line.split(':').collect::<Vec<_>>())
        .find(|fields| fields.len() > 3 && fields[0] == name)
        .and_then(|fields| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
        .ok_or_else(|| format!("no system user {name:?}"))
}

fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(listener.local_addr().map_err(|e| e.to_string())?.port())
}
