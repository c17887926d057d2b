//! A private PostgreSQL primary with a synchronous standby, for the fleet run
//! (`postgres_fleet`): Debian's server binaries, 127.0.0.1 only, ports picked free, data folders
//! of their own, every process stopped by pid.
//!
//! A failover is what a lost host looks like: the primary's postmaster and every process it
//! started are SIGKILLed, the standby is promoted, and a new standby is copied from the new primary
//! (`pg_basebackup -R`) onto the old primary's port, so the consumers' two-host connection
//! string stays valid. Commits are synchronous (`synchronous_commit = on`, and the primary names
//! every standby in `synchronous_standby_names`): an acknowledged commit is on both servers
//! before the client hears of it, so a promotion never loses one. The setting is made with
//! `ALTER SYSTEM` once the standby streams, and removed from the standby's copy: a freshly
//! promoted server must not wait for a standby it does not have yet. [`Cluster`] keeps the pair
//! and makes the failovers.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio_postgres::{Client, NoTls};

use crate::BoxError;
use crate::ledger::monotonic_ns;

/// One server: its data folder, port, and process (the leader of its own process group).
pub struct Node {
    pub name: String,
    pub port: u16,
    pub data: PathBuf,
    child: Option<Child>,
}

/// The server binaries, and the user they run as when we are root (PostgreSQL refuses to run
/// as root).
pub struct Binaries {
    bin: PathBuf,
    user: Option<(u32, u32)>,
}

impl Binaries {
    /// Finds the newest server under /usr/lib/postgresql, or says why there is none.
    pub fn find() -> Result<Binaries, BoxError> {
        let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .map_err(|_| "PostgreSQL is not installed (apt-get install postgresql)")?
            .filter_map(|entry| entry.ok().map(|entry| entry.path().join("bin")))
            .filter(|bin| bin.join("postgres").exists())
            .collect();
        found.sort();
        let bin = found
            .pop()
            .ok_or("no PostgreSQL server under /usr/lib/postgresql")?;
        // SAFETY: geteuid has no preconditions.
        let user = if unsafe { libc::geteuid() } == 0 {
            Some(system_user("postgres")?)
        } else {
            None
        };
        Ok(Binaries { bin, user })
    }

    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(self.bin.join(program));
        if let Some((uid, gid)) = self.user {
            command.uid(uid).gid(gid);
        }
        command
    }

    /// Makes `dir` the server user's, readable by nobody else (the server refuses a data
    /// folder others can read).
    pub fn own(&self, dir: &Path) -> Result<(), BoxError> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        if let Some((uid, gid)) = self.user {
            std::os::unix::fs::chown(dir, Some(uid), Some(gid))?;
        }
        Ok(())
    }

    /// A new primary in `data` (which must not exist yet): initdb, then started.
    pub fn primary(&self, name: &str, data: PathBuf) -> Result<Node, BoxError> {
        self.own(&data)?;
        let output = self
            .command("initdb")
            .arg("-D")
            .arg(&data)
            .args(["--auth=trust", "--username=postgres", "--encoding=UTF8"])
            .output()?;
        if !output.status.success() {
            return Err(format!("initdb: {}", String::from_utf8_lossy(&output.stderr)).into());
        }
        let mut node = Node {
            name: name.to_owned(),
            port: free_port()?,
            data,
            child: None,
        };
        self.start(&mut node)?;
        Ok(node)
    }

    /// A standby of `primary` in `data` on `port`: a base backup with the replication settings
    /// (`-R`), without the primary's synchronous-standby setting, then started.
    pub fn standby(
        &self,
        primary: &Node,
        name: &str,
        data: PathBuf,
        port: u16,
    ) -> Result<Node, BoxError> {
        self.own(&data)?;
        let output = self
            .command("pg_basebackup")
            .arg("-D")
            .arg(&data)
            .arg("-d")
            .arg(format!(
                "host=127.0.0.1 port={} user=postgres application_name={name}",
                primary.port
            ))
            .args(["-R", "-X", "stream", "-c", "fast"])
            .output()?;
        if !output.status.success() {
            return Err(
                format!("pg_basebackup: {}", String::from_utf8_lossy(&output.stderr)).into(),
            );
        }
        let auto_conf = data.join("postgresql.auto.conf");
        let kept: String = std::fs::read_to_string(&auto_conf)?
            .lines()
            .filter(|line| !line.trim_start().starts_with("synchronous_standby_names"))
            .map(|line| format!("{line}\n"))
            .collect();
        std::fs::write(&auto_conf, kept)?;
        let mut node = Node {
            name: name.to_owned(),
            port,
            data,
            child: None,
        };
        self.start(&mut node)?;
        Ok(node)
    }

    fn start(&self, node: &mut Node) -> Result<(), BoxError> {
        let log = std::fs::File::create(node.data.with_extension("log"))?;
        let mut command = self.command("postgres");
        command
            .arg("-D")
            .arg(&node.data)
            .args([
                "-p",
                &node.port.to_string(),
                "-c",
                "listen_addresses=127.0.0.1",
            ])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", node.data.display()))
            // The standby's name in the primary's pg_stat_replication.
            .arg("-c")
            .arg(format!("cluster_name={}", node.name))
            .args(["-c", "max_connections=100", "-c", "fsync=on"])
            .args(["-c", "synchronous_commit=on"])
            // A standby whose primary is gone retries every this often; a promotion waits for
            // the current wait to end (5 s by default).
            .args(["-c", "wal_retrieve_retry_interval=100ms"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            // Its own process group, apart from the checker's terminal signals.
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; the closure touches nothing else.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        node.child = Some(command.spawn()?);
        self.wait_accepting(node)
    }

    /// Waits until `node` accepts connections (`pg_isready`: a listening server may still be
    /// starting up, and refuses them then).
    fn wait_accepting(&self, node: &mut Node) -> Result<(), BoxError> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(child) = &mut node.child
                && let Some(status) = child.try_wait()?
            {
                return Err(format!(
                    "postgres {} exited with {status}; log: {}",
                    node.name,
                    std::fs::read_to_string(node.log()).unwrap_or_default()
                )
                .into());
            }
            let ready = Command::new(self.bin.join("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &node.port.to_string()])
                .status()?;
            if ready.success() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("postgres {} not ready within 60 s", node.name).into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Node {
    /// A connection string for this server alone.
    pub fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres connect_timeout=5",
            self.port
        )
    }

    pub fn log(&self) -> PathBuf {
        self.data.with_extension("log")
    }

    pub async fn connect(&self) -> Result<Client, BoxError> {
        let (client, connection) = tokio_postgres::connect(&self.url(), NoTls).await?;
        tokio::spawn(connection);
        Ok(client)
    }

    /// Names every standby synchronous (`ALTER SYSTEM`, reloaded) and waits until one streams
    /// as `sync`: from then on every acknowledged commit is on both servers.
    pub async fn require_sync_standby(&self) -> Result<(), BoxError> {
        let client = self.connect().await?;
        // Two statements: ALTER SYSTEM refuses to run in the implicit transaction of a
        // multi-statement string.
        client
            .batch_execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            .await?;
        client.batch_execute("SELECT pg_reload_conf()").await?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let synchronous: i64 = client
                .query_one(
                    "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
                    &[],
                )
                .await?
                .get(0);
            if synchronous > 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("no synchronous standby on {} within 60 s", self.name).into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Promotes this standby and waits until it accepts writes.
    pub async fn promote(&self) -> Result<(), BoxError> {
        let client = self.connect().await?;
        let promoted: bool = client
            .query_one("SELECT pg_promote(true, 60)", &[])
            .await?
            .get(0);
        if !promoted {
            return Err(format!("{} was not promoted within 60 s", self.name).into());
        }
        Ok(())
    }

    /// SIGKILLs the server as a lost host would lose it: the postmaster and every process it
    /// started, at once, and waits for the postmaster. (Each backend leads a process group of
    /// its own, so a signal to the postmaster's group would miss them; they would linger until
    /// they noticed the postmaster's death.) The postmaster is stopped first, so that it forks
    /// nothing while its children are listed.
    pub fn kill(&mut self) -> Result<(), BoxError> {
        if let Some(mut child) = self.child.take() {
            let postmaster = libc::pid_t::try_from(child.id())?;
            // SAFETY: signalling our child by its pid; it has not been waited for yet.
            unsafe { libc::kill(postmaster, libc::SIGSTOP) };
            let children = children_of(postmaster);
            // SAFETY: as above; the children are the postmaster's, which cannot reap them while
            // stopped, so their pids are not reused.
            unsafe {
                libc::kill(postmaster, libc::SIGKILL);
                for pid in children {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
            child.wait()?;
        }
        Ok(())
    }

    /// Stops the server (SIGINT: a fast shutdown) and waits for it.
    pub fn stop(&mut self) -> Result<(), BoxError> {
        if let Some(mut child) = self.child.take() {
            let pid = libc::pid_t::try_from(child.id())?;
            // SAFETY: signalling our child by its pid; it has not been waited for yet.
            unsafe { libc::kill(pid, libc::SIGINT) };
            child.wait()?;
        }
        Ok(())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// The primary and its synchronous standby; the standby's place is taken by a new copy after
/// every failover.
pub struct Cluster {
    binaries: Binaries,
    dir: PathBuf,
    pub primary: Node,
    pub standby: Option<Node>,
    /// Servers made so far: names and folders are `node<N>`.
    made: usize,
}

/// One failover's times, on the system-wide monotonic clock.
pub struct Failover {
    pub killed_ns: u64,
    pub promoted_ns: u64,
}

impl Cluster {
    /// A primary in `dir/node0`, and a standby of it in `dir/node1` if `with_standby` (the
    /// caller then requires it synchronous once it is ready to).
    pub fn new(dir: &Path, with_standby: bool) -> Result<Cluster, BoxError> {
        let binaries = Binaries::find()?;
        binaries.own(dir)?;
        let primary = binaries.primary("node0", dir.join("node0"))?;
        let mut cluster = Cluster {
            binaries,
            dir: dir.to_owned(),
            primary,
            standby: None,
            made: 1,
        };
        if with_standby {
            let port = free_port()?;
            cluster.add_standby(port)?;
        }
        Ok(cluster)
    }

    fn add_standby(&mut self, port: u16) -> Result<(), BoxError> {
        let name = format!("node{}", self.made);
        self.made += 1;
        let standby = self
            .binaries
            .standby(&self.primary, &name, self.dir.join(&name), port)?;
        self.standby = Some(standby);
        Ok(())
    }

    /// The consumers' connection string: both ports, and only a server that accepts writes
    /// will do, so a reconnect after a failover finds the new primary.
    pub fn conninfo(&self) -> String {
        let mut ports = vec![self.primary.port.to_string()];
        if let Some(standby) = &self.standby {
            ports.push(standby.port.to_string());
        }
        let hosts = vec!["127.0.0.1"; ports.len()];
        format!(
            "host={} port={} user=postgres dbname=postgres target_session_attrs=read-write \
             connect_timeout=2",
            hosts.join(","),
            ports.join(",")
        )
    }

    /// Kills the primary as a lost host dies, promotes the synchronous standby, and copies a
    /// new standby onto the old primary's port.
    pub async fn fail_over(&mut self) -> Result<Failover, BoxError> {
        // Only a primary with a streaming synchronous standby may be lost without losing an
        // acknowledged commit.
        self.primary.require_sync_standby().await?;
        let standby = self.standby.take().ok_or("no standby to promote")?;
        self.primary.kill()?;
        // Taken once every process of the primary has been sent its SIGKILL: until then its
        // backends still serve (the kill stops the postmaster, then lists its children), and
        // a commit they acknowledge is not one of the new primary's.
        let killed_ns = monotonic_ns();
        standby.promote().await?;
        let promoted_ns = monotonic_ns();
        let old = std::mem::replace(&mut self.primary, standby);
        let old_port = old.port;
        let old_data = old.data.clone();
        drop(old);
        std::fs::remove_dir_all(&old_data)?;
        self.add_standby(old_port)?;
        self.primary.require_sync_standby().await?;
        Ok(Failover {
            killed_ns,
            promoted_ns,
        })
    }
}

/// The processes whose parent is `parent`, from /proc.
fn children_of(parent: libc::pid_t) -> Vec<libc::pid_t> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| {
            entry
                .ok()?
                .file_name()
                .to_str()?
                .parse::<libc::pid_t>()
                .ok()
        })
        .filter(|pid| {
            // /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after
            // its closing parenthesis.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let rest = &stat[stat.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<libc::pid_t>().ok()
                })
                == Some(parent)
        })
        .collect()
}

fn system_user(name: &str) -> Result<(u32, u32), BoxError> {
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    passwd
        .lines()
        .map(|line| line.split(':').collect::<Vec<_>>())
        .find(|fields| fields.len() > 3 && fields[0] == name)
        .and_then(|fields| Some((fields[2].parse().ok()?, fields[3].parse().ok()?)))
        .ok_or_else(|| format!("no system user {name:?}").into())
}

/// A port nothing listens on now, on 127.0.0.1.
pub fn free_port() -> Result<u16, BoxError> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}
