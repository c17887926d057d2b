//! The machine a run measured, printed with every result: figures from one machine do not carry
//! over to another.

use std::fmt;
use std::path::Path;
use std::process::Command;

pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub memory_gib: f64,
    pub kernel: String,
    /// The file system the stores were on (device and type), from /proc/mounts.
    pub file_system: String,
    pub versions: Vec<(String, String)>,
}

impl Machine {
    pub fn describe(store_dir: &Path) -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|line| line.strip_prefix("model name"))
            .map(|rest| rest.trim_start_matches([' ', '\t', ':']).to_owned())
            .unwrap_or_else(|| "unknown CPU".to_owned());
        let memory_kib: f64 = std::fs::read_to_string("/proc/meminfo")
            .unwrap_or_default()
            .lines()
            .find_map(|line| line.strip_prefix("MemTotal:"))
            .and_then(|rest| rest.trim().trim_end_matches(" kB").parse().ok())
            .unwrap_or(0.0);
        let versions = vec![
            ("idemdb".to_owned(), env!("CARGO_PKG_VERSION").to_owned()),
            (
                "RocksDB".to_owned(),
                "11.8.1 (rust-rocksdb 0.25.0)".to_owned(),
            ),
            ("SQLite".to_owned(), rusqlite::version().to_owned()),
            (
                "Redis".to_owned(),
                first_line("redis-server", &["--version"]),
            ),
            ("PostgreSQL".to_owned(), postgres_version()),
        ];
        Machine {
            cpu,
            cores: std::thread::available_parallelism().map_or(0, usize::from),
            memory_gib: memory_kib / (1024.0 * 1024.0),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_owned())
                .unwrap_or_default(),
            file_system: file_system_of(store_dir),
            versions,
        }
    }
}

impl fmt::Display for Machine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "machine: {}, {} cores, {:.1} GiB RAM, Linux {}, stores on {}",
            self.cpu, self.cores, self.memory_gib, self.kernel, self.file_system
        )?;
        let versions: Vec<String> = self
            .versions
            .iter()
            .map(|(name, version)| format!("{name} {version}"))
            .collect();
        write!(f, "versions: {}", versions.join("; "))
    }
}

fn first_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|out| out.lines().next().map(str::to_owned))
        .unwrap_or_else(|| "not installed".to_owned())
}

fn postgres_version() -> String {
    let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") else {
        return "not installed".to_owned();
    };
    let mut bins: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path().join("bin/postgres")))
        .filter(|p| p.exists())
        .collect();
    bins.sort();
    match bins.pop() {
        Some(bin) => first_line(&bin.to_string_lossy(), &["--version"]),
        None => "not installed".to_owned(),
    }
}

/// The mount holding `path`: the longest mount point that prefixes it.
fn file_system_of(path: &Path) -> String {
    let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    mounts
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.len() >= 3 && path.starts_with(fields[1]))
                .then(|| (fields[1].len(), format!("{} ({})", fields[0], fields[2])))
        })
        .max_by_key(|(len, _)| *len)
        .map_or_else(|| "unknown".to_owned(), |(_, fs)| fs)
}
