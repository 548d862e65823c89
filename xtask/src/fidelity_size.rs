//! `cargo xtask bench fidelity-size`: does the quantization's error grow with
//! the model? `python/bench/fidelity_size.py` under torchrun (2 nodes x 2)
//! trains a Hugging Face Llama at each width of [`SIZES`] for [`STEPS`] steps
//! with zeropp.torch's defaults, and at steps 1, 10 and the last compares what
//! qgZ and qwZ deliver with the exact collective of the same inputs, per layer
//! kind. The report (`target/bench-report/fidelity-size.md`) tabulates the
//! relative errors against the parameters, and the plot
//! (`target/bench-report/fidelity-size.svg`) draws them; CI's test 7 runs the
//! largest width for one step with bounds set from this curve.
//!
//! Its `loss` part (`ZEROPP_FIDELITY_SIZE_PARTS=error,loss`, both by default)
//! trains the same family for 600 steps with and without zeropp.torch
//! (`python/bench/hf_parity.py`, 2 seeds) at the widths and corpora of
//! [`LOSS_RUNS`] and tabulates the validation-loss ratio per size, with
//! FSDP2's own seed spread and the ratio at 25%, 50% and 100% of the run.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::cmd::{root, run};
use crate::torch::{FIDELITY_SIZES as SIZES, fidelity_size_args as size_args, prepare, torchrun};

/// Training steps of each width; probed at 1, 10 and the last.
const STEPS: usize = 12;

/// The loss runs: (corpus, hidden, layers, variants against FSDP2's default).
/// `stdlib` is Python's standard library sources (31.5M characters, 46 times
/// what a run trains on), `shakespeare` tinyshakespeare (1.1M, at the
/// smallest width only).
const LOSS_RUNS: [(&str, usize, usize, &str); 3] = [
    ("stdlib", 128, 4, "zeropp,qwz,qgz,qgz-rtn"),
    ("stdlib", 192, 4, "zeropp"),
    ("shakespeare", 128, 4, "zeropp"),
];
/// hf_parity.py's run: steps, seeds, heads (key/value heads half), vocabulary (printable ASCII).
const LOSS_STEPS: usize = 600;
const LOSS_SEEDS: usize = 2;
const LOSS_HEADS: usize = 4;
const LOSS_VOCAB: usize = 96;

/// One width's result: parameters and, per probed step, the figures of
/// `grad/KIND` and `weight/KIND`.
struct Run {
    params: f64,
    probes: Vec<(usize, Value)>,
}

/// Over the kinds of `what` (`grad` or `weight`) at one probe: (mean, least, largest) of `field`.
fn over_kinds(probe: &Value, what: &str, field: &str) -> (f64, f64, f64) {
    let v: Vec<f64> = probe
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| k.starts_with(&format!("{what}/")))
        .filter_map(|(_, r)| r.get(field).and_then(Value::as_f64))
        .collect();
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (lo, hi) = (v.iter().copied().fold(f64::NAN, f64::min), v.iter().copied().fold(f64::NAN, f64::max));
    (if v.is_empty() { f64::NAN } else { mean }, lo, hi)
}

pub(crate) fn bench(report_dir: &Path) -> Result<(), String> {
    let venv = prepare()?.ok_or("bench fidelity-size: no torch venv (see cargo xtask torch test)")?;
    let parts = std::env::var("ZEROPP_FIDELITY_SIZE_PARTS").unwrap_or_else(|_| "error,loss".into());
    let (error, loss) = (parts.split(',').any(|p| p == "error"), parts.split(',').any(|p| p == "loss"));
    if !error && !loss {
        return Err(format!("ZEROPP_FIDELITY_SIZE_PARTS={parts}: expected error, loss or both"));
    }
    let mut md = String::new();
    if error {
        md.push_str(&error_part(&venv, report_dir)?);
    }
    if loss {
        md.push_str(&loss_part(&venv)?);
    }
    let out = report_dir.join("fidelity-size.md");
    std::fs::write(&out, md).map_err(|e| format!("{}: {e}", out.display()))?;
    eprintln!("==> wrote {}", out.display());
    Ok(())
}

/// ZEROPP_FIDELITY_SIZE_REUSE=1 redraws the report from the last run's files.
fn reuse() -> bool {
    std::env::var("ZEROPP_FIDELITY_SIZE_REUSE").is_ok_and(|v| v == "1")
}

/// The error curve: each width of [`SIZES`], a table and `fidelity-size.svg`.
fn error_part(venv: &Path, report_dir: &Path) -> Result<String, String> {
    let dir = root().join("target/fidelity-size");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut runs = Vec::new();
    for size in SIZES {
        let out: PathBuf = dir.join(format!("d{}.json", size.0));
        if !reuse() {
            let _ = std::fs::remove_file(&out);
            let mut args = size_args(size);
            args.extend(["--steps".into(), STEPS.to_string(), "--probe".into(), "1,10,last".into()]);
            args.extend(["--out".into(), out.display().to_string()]);
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            let c = torchrun(venv, "python/bench/fidelity_size.py", &refs, None)?;
            run(&format!("bench fidelity-size: d {}", size.0), c)?;
        }
        let text = std::fs::read_to_string(&out).map_err(|e| format!("{}: {e}", out.display()))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", out.display()))?;
        let params = v.get("params").and_then(Value::as_f64).ok_or("fidelity_size.py wrote no params")?;
        let mut probes: Vec<(usize, Value)> = v
            .get("probes")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
            .filter_map(|(k, p)| k.parse().ok().map(|s| (s, p.clone())))
            .collect();
        probes.sort_by_key(|p| p.0);
        if probes.len() != 3 {
            return Err(format!("{}: {} probed steps, expected 3", out.display(), probes.len()));
        }
        runs.push(Run { params, probes });
    }
    let md = report(&runs)?;
    let svg = report_dir.join("fidelity-size.svg");
    plot(&runs, &svg)?;
    eprintln!("==> drew {}", svg.display());
    Ok(md)
}

/// Python's standard library sources (not site-packages), every `.py` file in
/// sorted order, as one text: `target/fidelity/python-stdlib.txt`.
fn python_stdlib() -> Result<PathBuf, String> {
    let dir = root().join("target/fidelity");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join("python-stdlib.txt");
    let script = "import os, sys, sysconfig\n\
                  root = sysconfig.get_paths()['stdlib']\n\
                  parts = []\n\
                  for d, dirs, files in os.walk(root):\n\
                  \x20   dirs[:] = sorted(x for x in dirs if x not in ('site-packages', '__pycache__'))\n\
                  \x20   parts += [open(os.path.join(d, f), encoding='utf-8', errors='replace').read()\n\
                  \x20             for f in sorted(files) if f.endswith('.py')]\n\
                  open(sys.argv[1], 'w', encoding='utf-8').write('\\n'.join(parts))\n";
    let mut c = std::process::Command::new("python3");
    c.args(["-c", script]).arg(&path);
    run("the Python standard library corpus", c)?;
    Ok(path)
}

/// HF Llama's parameters at hf_parity.py's shape: embeddings and head of
/// [`LOSS_VOCAB`], per layer the four projections (key/value heads half the
/// heads), the SwiGLU (`8d/3` rounded down to 8) and two norms; the final norm.
fn loss_params(d: usize, layers: usize) -> usize {
    let kv = d / LOSS_HEADS * (LOSS_HEADS / 2).max(1);
    let ff = d * 8 / 3 / 8 * 8;
    2 * LOSS_VOCAB * d + layers * (2 * d * d + 2 * d * kv + 3 * d * ff + 2 * d) + d
}

/// The loss curve: each run of [`LOSS_RUNS`], a table.
fn loss_part(venv: &Path) -> Result<String, String> {
    let dir = root().join("target/fidelity-size");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut md = format!(
        "\n# Validation loss with zeropp.torch against FSDP2's default, by model size (HF Llama, 2 x 2, \
         {LOSS_STEPS} steps, {LOSS_SEEDS} seeds)\n\n\
         | corpus | parameters | variant | FSDP2 val loss | FSDP2 seed spread | val ratio: mean | se | worst seed | \
         at 25% | at 50% | train ratio | training text / a run's tokens |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    let stdlib = python_stdlib()?;
    let shakespeare = root().join("../shared/data/tinyshakespeare.txt");
    for (corpus, d, layers, variants) in LOSS_RUNS {
        let path = if corpus == "stdlib" { stdlib.clone() } else { shakespeare.clone() };
        if !path.is_file() {
            eprintln!("==> {corpus} skipped: {} is absent", path.display());
            continue;
        }
        let out = dir.join(format!("loss-{corpus}-d{d}.json"));
        if !reuse() {
            let _ = std::fs::remove_file(&out);
            let args: Vec<String> = [
                "--data".to_string(),
                path.display().to_string(),
                "--seeds".into(),
                LOSS_SEEDS.to_string(),
                "--steps".into(),
                LOSS_STEPS.to_string(),
                "--hidden".into(),
                d.to_string(),
                "--layers".into(),
                layers.to_string(),
                "--heads".into(),
                LOSS_HEADS.to_string(),
                "--variants".into(),
                variants.into(),
                "--marks".into(),
                "0.25,0.5,1".into(),
                // The report judges; the run only records.
                "--min-mean".into(),
                "0".into(),
                "--max-mean".into(),
                "9".into(),
                "--max-worst".into(),
                "9".into(),
                "--out".into(),
                out.display().to_string(),
            ]
            .into();
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            run(
                &format!("bench fidelity-size: loss, {corpus}, d {d}"),
                torchrun(venv, "python/bench/hf_parity.py", &refs, None)?,
            )?;
        }
        let text = std::fs::read_to_string(&out).map_err(|e| format!("{}: {e}", out.display()))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", out.display()))?;
        md.push_str(&loss_rows(&v, corpus, loss_params(d, layers), variants)?);
    }
    Ok(md)
}

/// One loss run's rows, a row per variant.
fn loss_rows(v: &Value, corpus: &str, params: usize, variants: &str) -> Result<String, String> {
    let rows = v.get("rows").and_then(Value::as_array).ok_or("hf_parity.py wrote no rows")?;
    let f = |x: Option<&Value>| x.and_then(Value::as_f64).unwrap_or(f64::NAN);
    let base: Vec<f64> = rows.iter().map(|r| f(r.pointer("/default/val"))).collect();
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len().max(1) as f64;
    let spread = (base.iter().copied().fold(f64::NAN, f64::max)
        - base.iter().copied().fold(f64::NAN, f64::min))
        / mean(&base);
    let steps = v.pointer("/args/steps").and_then(Value::as_u64).unwrap_or(0);
    // hf_parity.py trains on the first 90% of the text.
    let ratio = 0.9 * f(v.get("tokens")) / f(v.get("tokens_per_run"));
    let mut md = String::new();
    for variant in variants.split(',') {
        let at = |k: String| -> Vec<f64> {
            rows.iter()
                .map(|r| {
                    f(r.get("ratios")
                        .and_then(|x| x.get(variant))
                        .and_then(|x| x.get("val_at"))
                        .and_then(|x| x.get(&k)))
                })
                .collect()
        };
        // The marks as the run wrote them (the last is the run's end).
        let mut marks: Vec<u64> = rows
            .first()
            .and_then(|r| r.pointer("/default/val_at"))
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
            .filter_map(|(k, _)| k.parse().ok())
            .collect();
        marks.sort_unstable();
        if marks.len() != 3 || marks.last() != Some(&steps) {
            return Err(format!("hf_parity.py's marks are {marks:?}, expected three ending at step {steps}"));
        }
        let vals = at(steps.to_string());
        if vals.is_empty() || vals.iter().any(|x| !x.is_finite()) {
            return Err(format!("{corpus}, {params} parameters: the run has no {variant} ratio (rerun it)"));
        }
        let m = mean(&vals);
        let sd = (vals.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (vals.len().max(2) - 1) as f64).sqrt();
        let se = sd / (vals.len() as f64).sqrt();
        let worst = vals.iter().copied().fold(f64::NAN, f64::max);
        let (quarter, half) = (mean(&at(marks[0].to_string())), mean(&at(marks[1].to_string())));
        let train: Vec<f64> = rows
            .iter()
            .map(|r| f(r.get("ratios").and_then(|x| x.get(variant)).and_then(|x| x.get("train"))))
            .collect();
        let _ = writeln!(
            md,
            "| {corpus} | {:.2}M | {variant} | {:.4} | {:.2}% | {m:.4} | {se:.4} | {worst:.4} | {quarter:.4} | {half:.4} | {:.4} | {ratio:.0}x |",
            params as f64 / 1e6,
            mean(&base),
            100.0 * spread,
            mean(&train)
        );
    }
    Ok(md)
}

fn report(runs: &[Run]) -> Result<String, String> {
    let mut md = String::from(
        "# qwZ and qgZ against the exact collectives, by model size (HF Llama, 2 x 2, zeropp.torch's defaults)\n\n\
         Relative norm error `|q - e| / |e|` over the layer kinds (mean, worst kind), qgZ's cosine (worst kind), \
         and the relative error of AdamW's update direction with qgZ's gradient against the exact one.\n\n\
         | parameters | step | qgZ rel. error: mean | worst kind | qgZ cosine: worst | AdamW update rel. error: mean | worst | qwZ rel. error: mean | worst |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        for (step, p) in &r.probes {
            let (g, _, gw) = over_kinds(p, "grad", "rel_norm_error");
            let (_, cos, _) = over_kinds(p, "grad", "cosine");
            let (u, _, uw) = over_kinds(p, "grad", "update_rel_error");
            let (w, _, ww) = over_kinds(p, "weight", "rel_norm_error");
            let _ = writeln!(
                md,
                "| {:.1}M | {step} | {g:.4} | {gw:.4} | {cos:.4} | {u:.4} | {uw:.4} | {w:.5} | {ww:.5} |",
                r.params / 1e6
            );
        }
    }
    // The trend: the last step's mean errors, largest width over smallest.
    let last = |r: &Run, what: &str, field: &str| {
        r.probes.last().map_or(f64::NAN, |p| over_kinds(&p.1, what, field).0)
    };
    let (first, big) = (runs.first().ok_or("no runs")?, runs.last().ok_or("no runs")?);
    let _ = writeln!(
        md,
        "\nFrom {:.1}M to {:.1}M parameters ({:.0}x), at the last step: qgZ's error x{:.2}, the update's x{:.2}, \
         qwZ's x{:.2}.\n",
        first.params / 1e6,
        big.params / 1e6,
        big.params / first.params,
        last(big, "grad", "rel_norm_error") / last(first, "grad", "rel_norm_error"),
        last(big, "grad", "update_rel_error") / last(first, "grad", "update_rel_error"),
        last(big, "weight", "rel_norm_error") / last(first, "weight", "rel_norm_error"),
    );
    // Per kind at the largest width's last step.
    md.push_str("Per layer kind, the largest width, last step:\n\n| kind | qgZ rel. error | cosine | AdamW update rel. error | qwZ rel. error |\n|---|---|---|---|---|\n");
    if let Some((_, p)) = big.probes.last() {
        // (Not a JSON pointer: the keys hold a slash.)
        let get =
            |k: &str, f: &str| p.get(k).and_then(|r| r.get(f)).and_then(Value::as_f64).unwrap_or(f64::NAN);
        let kinds: Vec<String> = p
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(k, _)| k.strip_prefix("grad/").map(str::to_string))
            .collect();
        for k in kinds {
            let (g, w) = (format!("grad/{k}"), format!("weight/{k}"));
            let _ = writeln!(
                md,
                "| {k} | {:.4} | {:.4} | {:.4} | {:.5} |",
                get(&g, "rel_norm_error"),
                get(&g, "cosine"),
                get(&g, "update_rel_error"),
                get(&w, "rel_norm_error")
            );
        }
    }
    Ok(md)
}

/// The last step's mean relative errors against the parameters, log-log.
fn plot(runs: &[Run], path: &Path) -> Result<(), String> {
    use plotters::prelude::*;
    let series: [(&str, &str, &str, RGBColor); 3] = [
        ("qgZ gradient (INT4)", "grad", "rel_norm_error", RED),
        ("AdamW update from qgZ's gradient", "grad", "update_rel_error", BLUE),
        ("qwZ weights (INT8)", "weight", "rel_norm_error", GREEN),
    ];
    let points = |what: &str, field: &str| -> Vec<(f64, f64)> {
        runs.iter()
            .filter_map(|r| r.probes.last().map(|p| (r.params, over_kinds(&p.1, what, field).0)))
            .collect()
    };
    let all: Vec<f64> = series.iter().flat_map(|s| points(s.1, s.2)).map(|p| p.1).collect();
    let lo = all.iter().copied().fold(f64::INFINITY, f64::min) / 2.0;
    let hi = all.iter().copied().fold(0.0, f64::max) * 2.0;
    let (x0, x1) =
        (runs.first().map_or(1e5, |r| r.params) / 2.0, runs.last().map_or(1e9, |r| r.params) * 2.0);
    let area = SVGBackend::new(path, (720, 440)).into_drawing_area();
    let e = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    area.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&area)
        .caption("Relative error against the exact collective, by model size", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((x0..x1).log_scale(), (lo..hi).log_scale())
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("parameters")
        .y_desc("relative norm error, last step")
        .draw()
        .map_err(|x| e(&x))?;
    for (name, what, field, color) in series {
        let pts = points(what, field);
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled()))).map_err(|x| e(&x))?;
    }
    crate::plot::legend_and_present(&mut chart, &area).map_err(|x| e(&x))
}
