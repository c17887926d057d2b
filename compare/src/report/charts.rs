//! PNG charts of a run, drawn with plotters: latency CDFs, durable throughput by producers, and
//! throughput as the store grows.

use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;

use crate::contenders::{Kind, SWEEP_THREADS};
use crate::report::summarize;
use crate::workloads::scale::ScalePoint;
use crate::{Measured, PeersRun};

const SIZE: (u32, u32) = (960, 600);
const COLORS: [RGBColor; 7] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0x7f, 0x7f, 0x7f),
];

/// plotters draws text with a font it is given: DejaVu Sans, from Debian's fonts-dejavu-core
/// (scripts/compare.sh installs it).
fn register_font() -> Result<()> {
    static FONT: std::sync::OnceLock<&'static [u8]> = std::sync::OnceLock::new();
    if FONT.get().is_some() {
        return Ok(());
    }
    let bytes = std::fs::read("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
        .context("reading DejaVuSans.ttf (install fonts-dejavu-core)")?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    let _ = FONT.set(bytes);
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("DejaVuSans.ttf is not a usable font"))?;
    Ok(())
}

fn plot_error<E: std::fmt::Debug>(error: E) -> anyhow::Error {
    anyhow::anyhow!("drawing a chart: {error:?}")
}

pub fn peers(out_dir: &Path, run: &PeersRun) -> Result<()> {
    register_font()?;
    latency_cdf(&out_dir.join("latency-cdf.png"), run)?;
    durable_threads(&out_dir.join("durable-threads.png"), run)?;
    Ok(())
}

/// Per-call latency CDF of single-message contenders, from each one's middle round.
fn latency_cdf(path: &Path, run: &PeersRun) -> Result<()> {
    let wanted = [
        "idemdb default buffered, 1 thread",
        "rocksdb get+write under lock, 1 thread",
        "rocksdb TransactionDB, 2 threads",
        "redis no persistence, 50 clients",
        "sqlite NORMAL, 1 row/txn",
        "postgres sync off, 8 clients",
        "idemdb default sync, 1 thread",
    ];
    let series: Vec<(&str, Vec<(f64, f64)>)> = wanted
        .iter()
        .filter_map(|name| {
            let measured = run.measured.iter().find(|m| m.spec.name == *name)?;
            Some((*name, cdf_points(measured)))
        })
        .collect();
    if series.is_empty() {
        return Ok(());
    }
    let max_us = series
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.0))
        .fold(10.0f64, f64::max);
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Latency per message (CDF), no fsync unless named",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d((1.0f64..max_us * 1.2).log_scale(), 0.0f64..1.0)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("latency (microseconds, log scale)")
        .y_desc("fraction of calls")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(plot_error)?;
    for (index, (name, points)) in series.into_iter().enumerate() {
        let color = COLORS[index % COLORS.len()];
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(plot_error)?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    root.present().map_err(plot_error)?;
    Ok(())
}

/// (latency us, fraction) at 200 quantiles of the middle round.
fn cdf_points(measured: &Measured) -> Vec<(f64, f64)> {
    let sorted = &measured.rounds[measured.rounds.len() / 2].latencies_ns;
    (1..=200)
        .map(|i| {
            let q = f64::from(i) / 200.0;
            ((crate::workloads::quantile(sorted, q) / 1000.0).max(1.0), q)
        })
        .collect()
}

type KindFilter = fn(Kind) -> bool;

/// Durable single-message throughput by producer count: idemdb, PostgreSQL, Redis.
fn durable_threads(path: &Path, run: &PeersRun) -> Result<()> {
    let families: [(&str, KindFilter); 3] = [
        ("idemdb default sync", |k| {
            matches!(k, Kind::Idemdb(idemdb::Durability::Sync))
        }),
        ("postgres synchronous_commit on", |k| {
            matches!(
                k,
                Kind::Postgres {
                    synchronous_commit: true
                }
            )
        }),
        ("redis appendfsync always", |k| {
            matches!(k, Kind::Redis { fsync_always: true })
        }),
    ];
    let series: Vec<(&str, Vec<(f64, f64)>)> = families
        .iter()
        .map(|(label, is)| {
            let points = run
                .measured
                .iter()
                .filter(|m| {
                    is(m.spec.kind) && m.spec.shape.batch == 1 && m.spec.shape.pipeline == 1
                })
                .filter(|m| {
                    SWEEP_THREADS.contains(&m.spec.shape.threads) || m.spec.shape.threads == 50
                })
                .map(|m| (m.spec.shape.threads as f64, summarize(m).per_second))
                .collect::<Vec<_>>();
            (*label, points)
        })
        .filter(|(_, points)| !points.is_empty())
        .collect();
    if series.is_empty() {
        return Ok(());
    }
    let max_rate = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| p.1))
        .fold(1.0f64, f64::max);
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Durable claims per second by concurrent producers",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((1.0f64..64.0).log_scale(), 0.0f64..max_rate * 1.15)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("producers (threads or client connections, log scale)")
        .y_desc("messages per second")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(plot_error)?;
    for (index, (label, points)) in series.into_iter().enumerate() {
        let color = COLORS[index % COLORS.len()];
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(plot_error)?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 4, color.filled())),
            )
            .map_err(plot_error)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    root.present().map_err(plot_error)?;
    Ok(())
}

/// Throughput and p99 by stored records.
pub fn scale(out_dir: &Path, points: &[ScalePoint]) -> Result<()> {
    if points.is_empty() {
        return Ok(());
    }
    register_font()?;
    std::fs::create_dir_all(out_dir)?;
    let path = out_dir.join("scale.png");
    let millions = |r: u64| r as f64 / 1e6;
    let max_x = millions(points.last().expect("non-empty").records);
    let max_rate = points.iter().map(|p| p.per_second).fold(1.0f64, f64::max);
    let max_p99 = points.iter().map(|p| p.p99_us).fold(1.0f64, f64::max);
    let root = BitMapBackend::new(&path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Claim + commit as the store grows (no fsync)",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .right_y_label_area_size(60)
        .build_cartesian_2d(0.0f64..max_x * 1.02, 0.0f64..max_rate * 1.15)
        .map_err(plot_error)?
        .set_secondary_coord(0.0f64..max_x * 1.02, 0.0f64..max_p99 * 1.3);
    chart
        .configure_mesh()
        .x_desc("stored records (millions)")
        .y_desc("messages per second")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(plot_error)?;
    chart
        .configure_secondary_axes()
        .y_desc("p99 latency (us)")
        .draw()
        .map_err(plot_error)?;
    let rate: Vec<(f64, f64)> = points
        .iter()
        .map(|p| (millions(p.records), p.per_second))
        .collect();
    let p99: Vec<(f64, f64)> = points
        .iter()
        .map(|p| (millions(p.records), p.p99_us))
        .collect();
    chart
        .draw_series(LineSeries::new(rate, COLORS[0].stroke_width(2)))
        .map_err(plot_error)?
        .label("messages per second (left)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], COLORS[0].stroke_width(2)));
    chart
        .draw_secondary_series(LineSeries::new(p99, COLORS[1].stroke_width(2)))
        .map_err(plot_error)?
        .label("p99 latency, us (right)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], COLORS[1].stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    root.present().map_err(plot_error)?;
    Ok(())
}
