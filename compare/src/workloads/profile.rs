//! `profile`: one embedded contender's deliveries on the calling thread, for a profiler.
//!
//! Wall-clock figures on a shared 2-core VM are noisy; instruction counts are not. Run under
//! `valgrind --tool=callgrind --collect-atstart=no --toggle-collect=*profiled_deliveries*`
//! (`scripts/profile.sh` does), only the deliveries are counted: no store setup, no warm-up.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use crate::contenders::{self, Ports};
use crate::workloads::{Delivery, Generator};

#[derive(Args, Clone)]
pub struct ProfileArgs {
    /// The contender, by its exact name (as in BENCHMARKS.md); embedded contenders only.
    #[arg(long)]
    pub contender: String,
    /// Messages delivered while counted.
    #[arg(long, default_value_t = 100_000)]
    pub messages: u64,
    /// Share of deliveries that re-send an earlier message.
    #[arg(long, default_value_t = 0.1)]
    pub duplicate_ratio: f64,
    /// Where the store lives (a temporary directory when absent).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

pub fn run(args: &ProfileArgs) -> Result<()> {
    let spec = contenders::all()
        .into_iter()
        .find(|spec| spec.name == args.contender)
        .with_context(|| format!("no contender named {:?}", args.contender))?;
    anyhow::ensure!(
        !spec.needs_redis() && !spec.needs_postgres(),
        "{} needs a server; profile an embedded contender",
        spec.name
    );
    let temp = tempfile::Builder::new()
        .prefix("idemdb-profile-")
        .tempdir()?;
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| temp.path().join("store"));
    std::fs::create_dir_all(&dir)?;
    // No server is started: the ports are never used.
    let ports = Ports {
        redis: 0,
        redis_fsync: 0,
        postgres: 0,
    };
    let mut prepared = contenders::prepare(&spec, &dir, ports)?;
    let session = prepared
        .sessions
        .first_mut()
        .context("the contender has no session")?;
    let per_call = spec.shape.batch * spec.shape.pipeline;
    let mut generator = Generator::new(0, 0x1de3_d000, args.duplicate_ratio);
    let calls = args.messages.div_ceil(per_call as u64);
    let calls_made = profiled_deliveries(&mut **session, &mut generator, per_call, calls)?;
    println!(
        "profile: {} messages ({} calls of {}) through {:?}",
        calls_made * per_call as u64,
        calls_made,
        per_call,
        spec.name
    );
    Ok(())
}

/// The counted part: `calls` calls of `per_call` deliveries each. Not inlined, so that the
/// profiler can switch counting on and off by its name.
#[inline(never)]
fn profiled_deliveries(
    session: &mut dyn crate::workloads::Session,
    generator: &mut Generator,
    per_call: usize,
    calls: u64,
) -> Result<u64> {
    let mut deliveries: Vec<Delivery> = Vec::with_capacity(per_call);
    for _ in 0..calls {
        deliveries.clear();
        deliveries.extend((0..per_call).map(|_| generator.next_delivery()));
        session.deliver(&deliveries)?;
    }
    Ok(calls)
}
