//! `cargo xtask bench cluster`: step-time speedups over ZeRO-3 per inter-node rate on
//! the cluster, against the thread backend's link model for the same configuration
//! (report, CSV and SVG plot), with ZeRO++ with SDP4Bit's techniques
//! (`--mode zeropp-delta`) beside ZeRO++, and every variant's bytes on the node
//! uplinks from the kernel's counters.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::checks::threads_run;
use super::run::kernel_tx;
use super::test::{missing_prerequisite, train};
use super::{Launch, Shape, build_zeropp, rate_bits, read_metrics, tail, target_dir};

/// What a cluster bench starts from: its prerequisites checked (`bench` names
/// it in the refusal), the release `zeropp` binary built, and the link rates
/// to sweep from `$rates_var` (comma-separated) or `default_rates`.
pub(super) fn bench_setup(
    bench: &str,
    rates_var: &str,
    default_rates: &str,
) -> Result<(PathBuf, Vec<String>), String> {
    if let Some(why) = missing_prerequisite() {
        return Err(format!("bench {bench} cannot run: {why}"));
    }
    let zeropp = build_zeropp(true, "dev")?;
    let rates = std::env::var(rates_var).unwrap_or_else(|_| default_rates.into());
    Ok((zeropp, rates.split(',').map(String::from).collect()))
}

/// `cargo xtask bench cluster`: see the module doc.
pub(crate) fn bench(report_dir: &Path) -> Result<(), String> {
    let (zeropp, rates) =
        bench_setup("cluster", "ZEROPP_CLUSTER_RATES", "10mbit,50mbit,200mbit,1gbit,unshaped")?;
    let model = std::env::var("ZEROPP_CLUSTER_MODEL").unwrap_or_else(|_| "gpt-medium".into());
    let variants: [(&str, &[&str]); 6] = [
        ("ZeRO-3", &["--mode", "zero3"]),
        ("qwZ", &["--mode", "zero3", "--qwz"]),
        ("hpZ", &["--mode", "zero3", "--hpz", "2"]),
        ("qgZ", &["--mode", "zero3", "--qgz"]),
        ("ZeRO++", &["--mode", "zeropp"]),
        ("ZeRO++ delta", &["--mode", "zeropp-delta"]),
    ];
    let base = target_dir().join("cluster/bench");
    let _ = std::fs::remove_dir_all(&base);
    let shape0 = Shape::new(2, 2, "unshaped");
    // rows[rate][variant] = (measured step s, predicted step s)
    let mut rows: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    // uplink[rate][variant] = kernel tx bytes of all node uplinks per step.
    let mut uplink: Vec<Vec<f64>> = Vec::new();
    let mut params = 0.0;
    for rate in &rates {
        // Slow rates: seconds per step, 6 steps; fast ones: 12 (the first is left out,
        // which is also zeropp-delta's full step).
        let steps = if rate_bits(rate).is_some_and(|b| b < 100e6) { "6" } else { "12" };
        let common = [
            "--model",
            model.as_str(),
            "--steps",
            steps,
            "--seed",
            "1",
            "--eval-batches",
            "0",
            "--batch",
            "4",
        ];
        let mut row = Vec::new();
        let mut tx = Vec::new();
        for (name, margs) in variants {
            let mut shape = shape0.clone();
            shape.rate = rate.clone();
            let out = base.join(rate).join(name.replace('+', "p").replace(' ', "-"));
            let opts = Launch { time_limit_s: 600, ..Launch::default() };
            let (o, metrics) = train(&shape, &out, (margs, &common), &opts, &zeropp)?;
            if !o.success {
                return Err(format!("bench cluster: {name} at {rate} failed:\n{}", tail(&o.log, 20)));
            }
            let (msteps, summary) = read_metrics(&metrics)?;
            params = summary.get("params").and_then(Value::as_f64).unwrap_or(params);
            let measured = steady_step_time(&msteps);
            tx.push(kernel_tx(&out)? / msteps.len().max(1) as f64);
            // The link model of the same configuration on the thread backend.
            let predicted_path = out.join("model.jsonl");
            let link = link_for(rate, shape.local_size);
            let args: Vec<String> = margs.iter().chain(&common).map(|s| s.to_string()).collect();
            threads_run(&zeropp, &shape, &args, &predicted_path, Some(&link))?;
            let (psteps, _) = read_metrics(&predicted_path)?;
            let predicted = steady_step_time(&psteps);
            eprintln!(
                "bench cluster: {rate} {name}: measured {measured:.3} s/step, link model {predicted:.3} s/step"
            );
            row.push((measured, predicted));
        }
        rows.push((rate.clone(), row));
        uplink.push(tx);
    }
    let names: Vec<&str> = variants.iter().map(|v| v.0).collect();
    let mut md = bench_report(&rows, &names, params, &model);
    let _ = writeln!(
        md,
        "\nBytes on the node uplinks per step (the kernel's tx counters of both nodes, start-up traffic \
         included, over the run's steps), and their ratio to ZeRO-3's; zeropp-delta's step time against \
         ZeRO++'s:\n\n| inter-node rate | ZeRO-3 bytes/step | {} | ZeRO++ delta / ZeRO++ step time |\n|---|---|{}---|",
        names[1..].join(" | "),
        "---|".repeat(names.len() - 1)
    );
    for ((rate, row), tx) in rows.iter().zip(&uplink) {
        let _ = write!(md, "| {rate} | {:.0} |", tx[0]);
        for t in &tx[1..] {
            let _ = write!(md, " {:.3} |", t / tx[0]);
        }
        let (zpp, delta) = (row[names.len() - 2].0, row[names.len() - 1].0);
        let _ = writeln!(md, " {:.3} |", delta / zpp);
    }
    let out = report_dir.join("cluster.md");
    std::fs::write(&out, &md).map_err(|e| format!("{}: {e}", out.display()))?;
    let csv = report_dir.join("cluster.csv");
    let mut c = String::from("rate_bits,variant,measured_s,predicted_s\n");
    for (rate, row) in &rows {
        for ((m, p), name) in row.iter().zip(variants.iter().map(|v| v.0)) {
            let _ = writeln!(c, "{},{name},{m},{p}", rate_bits(rate).unwrap_or(0.0));
        }
    }
    std::fs::write(&csv, c).map_err(|e| format!("{}: {e}", csv.display()))?;
    let svg = report_dir.join("cluster-speedup.svg");
    plot_speedup(&rows, &variants.iter().map(|v| v.0).collect::<Vec<_>>(), &svg)
        .map_err(|e| format!("{}: {e}", svg.display()))?;
    println!("{md}");
    eprintln!("==> wrote {}, {} and {}", out.display(), csv.display(), svg.display());
    Ok(())
}

/// The `--link` of the thread backend for a cluster rate, with the two corrections
/// the measurements asked for (see `LinkModel::parse`): the node's ranks share one
/// uplink (`inter_share`), and tbf counts Ethernet frames, of which TCP payload is 0.956
/// (`inter_framing=tcp`, what `cluster probe` measures one way).
/// `ZEROPP_CLUSTER_LINK=naive` leaves both out. Unshaped: the 1.2 Gbit/s order of
/// magnitude of the unshaped probe.
fn link_for(rate: &str, local_size: usize) -> String {
    let naive = std::env::var("ZEROPP_CLUSTER_LINK").is_ok_and(|v| v == "naive");
    let bits = rate_bits(rate).unwrap_or(1.2e9);
    let fix = if naive { String::new() } else { format!(",inter_share={local_size},inter_framing=tcp") };
    format!("intra=10GB/s,inter={bits}bit/s,latency=0{fix}")
}

/// Median step time without the first step (warm-up: connection set-up, allocation).
pub(super) fn steady_step_time(steps: &[Value]) -> f64 {
    median(steps.iter().skip(1).filter_map(|s| s.get("step_time_s").and_then(Value::as_f64)))
}

/// The median of `v` (NaN when empty).
pub(super) fn median(v: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = v.collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn bench_report(rows: &[(String, Vec<(f64, f64)>)], names: &[&str], params: f64, model: &str) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# bench `cluster`\n");
    let _ = writeln!(
        md,
        "2 nodes x 2 ranks (network namespaces, OpenMPI over TCP between nodes, shared memory within), \
         model `{model}` ({:.2} M parameters), global batch 4, median step time of 6 steps (below \
         100 Mbit/s) or 12 (the first left out), no added delay. \
         Machine: {}.\n",
        params / 1e6,
        crate::cmd::machine()
    );
    let _ =
        writeln!(md, "Step-time speedup over ZeRO-3 at the same rate (measured; link model in brackets):\n");
    let _ = write!(md, "| inter-node rate | ZeRO-3 s/step |");
    for n in &names[1..] {
        let _ = write!(md, " {n} |");
    }
    let _ = writeln!(md);
    let _ = writeln!(md, "|---|---|{}", "---|".repeat(names.len() - 1));
    for (rate, row) in rows {
        let (z3m, z3p) = row[0];
        let _ = write!(md, "| {rate} | {z3m:.3} ({z3p:.3}) |");
        for &(m, p) in &row[1..] {
            let _ = write!(md, " {:.2}x ({:.2}x) |", z3m / m, z3p / p);
        }
        let _ = writeln!(md);
    }
    let _ = writeln!(md, "\nMeasured / link-model step time:\n");
    let _ = write!(md, "| inter-node rate |");
    for n in names {
        let _ = write!(md, " {n} |");
    }
    let _ = writeln!(md);
    let _ = writeln!(md, "|---|{}", "---|".repeat(names.len()));
    for (rate, row) in rows {
        let _ = write!(md, "| {rate} |");
        for &(m, p) in row {
            let _ = write!(md, " {:.2} |", m / p);
        }
        let _ = writeln!(md);
    }
    md
}

/// Speedup over ZeRO-3 against the inter-node bandwidth (log scale), one colour per
/// variant: measured solid, link model dashed. Unshaped rows have no bandwidth and are
/// left out.
fn plot_speedup(rows: &[(String, Vec<(f64, f64)>)], names: &[&str], path: &Path) -> Result<(), String> {
    use plotters::prelude::*;
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let pts: Vec<(f64, &Vec<(f64, f64)>)> =
        rows.iter().filter_map(|(r, row)| rate_bits(r).map(|b| (b / 1e6, row))).collect();
    if pts.is_empty() {
        return Err("no shaped rate to plot".into());
    }
    let (lo, hi) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let top = pts
        .iter()
        .flat_map(|(_, row)| row.iter().map(move |&(m, p)| (row[0].0 / m).max(row[0].1 / p)))
        .fold(1.0f64, f64::max);
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("speedup over ZeRO-3 vs inter-node bandwidth (2 nodes x 2, TCP)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d((lo * 0.8..hi * 1.25).log_scale(), 0.0..top * 1.1)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("inter-node rate per node uplink (Mbit/s)")
        .y_desc("step-time speedup over ZeRO-3")
        .draw()
        .map_err(|x| e(&x))?;
    for (i, name) in names.iter().enumerate().skip(1) {
        let color = Palette99::pick(i).to_rgba();
        let measured: Vec<(f64, f64)> = pts.iter().map(|(x, row)| (*x, row[0].0 / row[i].0)).collect();
        let model: Vec<(f64, f64)> = pts.iter().map(|(x, row)| (*x, row[0].1 / row[i].1)).collect();
        chart
            .draw_series(LineSeries::new(measured, color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(format!("{name} (measured)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        chart
            .draw_series(DashedLineSeries::new(model, 6, 4, color.stroke_width(1)))
            .map_err(|x| e(&x))?
            .label(format!("{name} (link model)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(1)));
    }
    crate::plot::legend_and_present(&mut chart, &root)
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::{link_for, steady_step_time};

    #[test]
    fn steady_step_time_is_the_median_after_the_first_step() {
        let steps: Vec<Value> =
            [9.0, 1.0, 3.0, 2.0].iter().map(|t| serde_json::json!({ "step_time_s": t })).collect();
        assert_eq!(steady_step_time(&steps), 2.0);
        assert_eq!(steady_step_time(&steps[..3]), 2.0);
        assert!(steady_step_time(&steps[..1]).is_nan());
    }

    #[test]
    fn the_link_model_shares_the_uplink_and_pays_tcp_framing() {
        assert_eq!(
            link_for("100mbit", 2),
            "intra=10GB/s,inter=100000000bit/s,latency=0,inter_share=2,inter_framing=tcp"
        );
    }
}
