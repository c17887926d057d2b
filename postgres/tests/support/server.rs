//! A private PostgreSQL server for one test run: its own data directory in a temporary
//! directory, 127.0.0.1 only, a free port, stopped by pid (SIGINT, a fast shutdown) when
//! dropped, and by the kernel if the test process dies first.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Server {
    child: Child,
    pub port: u16,
    dir: tempfile::TempDir,
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
        let as_user = |command: &mut Command| {
            if let Some((uid, gid)) = user {
                command.uid(uid).gid(gid);
            }
        };
        let mut initdb = Command::new(bin.join("initdb"));
        initdb.arg("-D").arg(&data).args([
            "--auth=trust",
            "--username=postgres",
            "--encoding=UTF8",
        ]);
        as_user(&mut initdb);
        let output = initdb.output().map_err(|e| format!("initdb: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let port = free_port()?;
        let mut command = Command::new(bin.join("postgres"));
        command
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", data.display()))
            .args(["-c", "max_connections=100", "-c", "fsync=on"]);
        as_user(&mut command);
        // SAFETY: prctl is async-signal-safe; the closure touches nothing else.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGINT);
                Ok(())
            });
        }
        let log =
            std::fs::File::create(dir.path().join("postgres.log")).map_err(|e| e.to_string())?;
        let child = command
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting postgres: {e}"))?;
        let server = Server { child, port, dir };
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
