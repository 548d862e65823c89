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
//! The engine's GPT gets the same curve from the `size_error` example
//! (`zeropp-engine`), at the presets of [`ENGINE_MODELS`] up to GPT-2 small's
//! shape, drawn dashed on the same plot.
//!
//! Its `loss` part ([`loss`]) trains with and without the quantized
//! collectives for 600 steps over seeds, zeropp.torch against FSDP2 and the
//! engine's ZeRO++ against its ZeRO-3, and tabulates the validation-loss ratio
//! per size. `ZEROPP_FIDELITY_SIZE_PARTS` picks the parts (`error,loss,engine`
//! by default; without `engine` the engine's rows are left out of both).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::cmd::{cargo, root, run};
use crate::torch::{FIDELITY_SIZES as SIZES, fidelity_size_args as size_args, prepare, torchrun};

mod loss;

/// Training steps of each width; probed at 1, 10 and the last.
const STEPS: usize = 12;

/// The engine's GPT presets of the error curve (context 64): about 0.1M, 0.8M,
/// 10.7M, 39.6M and 85.6M parameters.
const ENGINE_MODELS: [&str; 5] = ["gpt", "gpt-1m", "gpt-10m", "gpt-40m", "gpt2-small"];

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
    let venv = Venv::default();
    let parts = std::env::var("ZEROPP_FIDELITY_SIZE_PARTS").unwrap_or_else(|_| "error,loss,engine".into());
    let has = |p: &str| parts.split(',').any(|x| x == p);
    if parts.split(',').any(|x| !["error", "loss", "engine"].contains(&x)) || !(has("error") || has("loss")) {
        return Err(format!(
            "ZEROPP_FIDELITY_SIZE_PARTS={parts}: expected error and/or loss, and engine or not"
        ));
    }
    let mut md = String::new();
    if has("error") {
        md.push_str(&error_part(&venv, report_dir, has("engine"))?);
    }
    if has("loss") {
        md.push_str(&loss::part(&venv, report_dir, has("engine"))?);
    }
    let out = report_dir.join("fidelity-size.md");
    std::fs::write(&out, md).map_err(|e| format!("{}: {e}", out.display()))?;
    eprintln!("==> wrote {}", out.display());
    Ok(())
}

/// The torch venv with the wheel, prepared at the first run that needs it
/// (a report redrawn from the files on disk builds nothing).
#[derive(Default)]
pub(crate) struct Venv(std::cell::OnceCell<PathBuf>);

impl Venv {
    pub(crate) fn get(&self) -> Result<&Path, String> {
        if self.0.get().is_none() {
            let v = prepare()?.ok_or("bench fidelity-size: no torch venv (see cargo xtask test-torch)")?;
            let _ = self.0.set(v);
        }
        self.0.get().map(PathBuf::as_path).ok_or_else(|| "the torch venv".to_string())
    }
}

/// ZEROPP_FIDELITY_SIZE_REUSE=1 keeps the runs whose files are on disk and
/// runs the rest; `only` runs nothing and leaves out what is not on disk.
fn reuse() -> bool {
    std::env::var("ZEROPP_FIDELITY_SIZE_REUSE").is_ok_and(|v| v == "1" || v == "only")
}

/// Whether the run writing `out` is left out: `REUSE=only` and no file.
fn left_out(out: &Path) -> bool {
    let only = std::env::var("ZEROPP_FIDELITY_SIZE_REUSE").is_ok_and(|v| v == "only");
    if only && !out.is_file() {
        eprintln!("==> left out (ZEROPP_FIDELITY_SIZE_REUSE=only): {} is not there", out.display());
    }
    only && !out.is_file()
}

/// The error curve: each width of [`SIZES`] (and of [`ENGINE_MODELS`] with
/// `engine`), a table each and `fidelity-size.svg`.
fn error_part(venv: &Venv, report_dir: &Path, engine: bool) -> Result<String, String> {
    let dir = root().join("target/fidelity-size");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // zeropp.torch's defaults (qgZ's rotation chosen from the gradients: on the
    // HF Llama, the MLP's down projections), then with every group rotated
    // (`qgz_hadamard=True`), then unrotated (`qgz_hadamard=False`).
    let (mut runs, mut rotated, mut unrotated) = (Vec::new(), Vec::new(), Vec::new());
    for (suffix, rotation, into) in
        [("", "default", &mut runs), ("-hadamard", "on", &mut rotated), ("-unrotated", "off", &mut unrotated)]
    {
        for size in SIZES {
            let out: PathBuf = dir.join(format!("d{}{suffix}.json", size.0));
            if left_out(&out) {
                continue;
            }
            if !(reuse() && out.is_file()) {
                let _ = std::fs::remove_file(&out);
                let mut args = size_args(size);
                args.extend(["--steps".into(), STEPS.to_string(), "--probe".into(), "1,10,last".into()]);
                args.extend([
                    "--qgz-rotation".into(),
                    rotation.into(),
                    "--out".into(),
                    out.display().to_string(),
                ]);
                let refs: Vec<&str> = args.iter().map(String::as_str).collect();
                let c = torchrun(venv.get()?, "python/bench/fidelity_size.py", &refs, None)?;
                run(&format!("bench fidelity-size: d {}, qgZ's rotation {rotation}", size.0), c)?;
            }
            into.push(read_run(&out)?);
        }
    }
    let mut md = report("HF Llama, 2 x 2, zeropp.torch's defaults", &runs)?;
    if !rotated.is_empty() {
        md.push_str(&report(
            "HF Llama, 2 x 2, zeropp.torch's defaults with every qgZ group rotated",
            &rotated,
        )?);
    }
    if !unrotated.is_empty() {
        md.push_str(&report("HF Llama, 2 x 2, zeropp.torch's defaults with qgZ unrotated", &unrotated)?);
    }
    let mut engine_runs = Vec::new();
    if engine {
        let mut built = false;
        for model in ENGINE_MODELS {
            let out: PathBuf = dir.join(format!("engine-{model}.json"));
            if left_out(&out) {
                continue;
            }
            if !(reuse() && out.is_file()) {
                if !built {
                    let mut c = cargo();
                    c.args([
                        "build",
                        "--locked",
                        "--release",
                        "-p",
                        "zeropp-engine",
                        "--example",
                        "size_error",
                    ]);
                    run("build the size_error example", c)?;
                    built = true;
                }
                let _ = std::fs::remove_file(&out);
                let mut c = std::process::Command::new(root().join("target/release/examples/size_error"));
                c.args(["--model", model, "--steps", &STEPS.to_string(), "--probe", "1,10,last"]);
                c.args(["--data", "shakespeare", "--out"]).arg(&out).current_dir(root());
                run(&format!("bench fidelity-size: the engine's {model}"), c)?;
            }
            engine_runs.push(read_run(&out)?);
        }
        // Under REUSE=only the engine's runs may all be left out.
        if !engine_runs.is_empty() {
            md.push_str(&report(
                "the engine's GPT, 2 x 2 thread ranks, context 64, `zeropp train`'s defaults",
                &engine_runs,
            )?);
        }
    }
    let svg = report_dir.join("fidelity-size.svg");
    plot(&runs, &rotated, &unrotated, &engine_runs, &svg)?;
    eprintln!("==> drew {}", svg.display());
    Ok(md)
}

/// One width's probes from its JSON (fidelity_size.py's or size_error's).
fn read_run(out: &Path) -> Result<Run, String> {
    let text = std::fs::read_to_string(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", out.display()))?;
    let params = v.get("params").and_then(Value::as_f64).ok_or(format!("{}: no params", out.display()))?;
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
    Ok(Run { params, probes })
}

fn report(who: &str, runs: &[Run]) -> Result<String, String> {
    let mut md = format!(
        "# qwZ and qgZ against the exact collectives, by model size ({who})\n\n\
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
    md.push_str(
        "\nPer layer kind, the largest width, last step (the ranks' spread is sqrt(sum over ranks |x_k|^2) / |sum|, \
         how much the ranks' gradients cancel; the error over it is INT4's on each rank's own gradient; the rotation \
         measure is the ranks' gradients' squared group maxima rotated over raw, which `qgz_hadamard=\"auto\"` \
         rotates below 0.5; \"weighed\" weighs each column by its input channel's mean square, as the loss's \
         second-order term does):\n\n\
         | kind | qgZ rel. error | cosine | AdamW update rel. error | ranks' spread | error / spread | rotation measure \
         | qgZ, weighed | update, weighed | qwZ rel. error |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
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
            // The engine's runs (and older files) carry no spread: a dash.
            let spread = get(&g, "rank_spread");
            let (sp, per) = if spread.is_finite() {
                (format!("{spread:.3}"), format!("{:.4}", get(&g, "rel_norm_error") / spread))
            } else {
                ("—".to_string(), "—".to_string())
            };
            // Older files carry no rotation measure: a dash.
            let measure = get(&g, "rotation_measure");
            let measure = if measure.is_finite() { format!("{measure:.3}") } else { "—".to_string() };
            // Older files carry no weighed errors: a dash.
            let weighed = |f: &str| {
                let v = get(&g, f);
                if v.is_finite() { format!("{v:.4}") } else { "—".to_string() }
            };
            let (wg, wu) = (weighed("act_rel_error"), weighed("act_update_rel_error"));
            let _ = writeln!(
                md,
                "| {k} | {:.4} | {:.4} | {:.4} | {sp} | {per} | {measure} | {wg} | {wu} | {:.5} |",
                get(&g, "rel_norm_error"),
                get(&g, "cosine"),
                get(&g, "update_rel_error"),
                get(&w, "rel_norm_error")
            );
        }
    }
    Ok(md)
}

/// The last step's mean relative errors against the parameters, log-log: the
/// HF Llama's solid, the engine's GPT's dashed; and the HF Llama's worst kind
/// of qgZ's gradient under the defaults (solid), with every group rotated
/// (dotted) and unrotated (dash-dotted).
fn plot(runs: &[Run], rotated: &[Run], unrotated: &[Run], engine: &[Run], path: &Path) -> Result<(), String> {
    use plotters::prelude::*;
    let series: [(&str, &str, &str, RGBColor); 3] = [
        ("qgZ gradient (INT4)", "grad", "rel_norm_error", RED),
        ("AdamW update from qgZ's gradient", "grad", "update_rel_error", BLUE),
        ("qwZ weights (INT8)", "weight", "rel_norm_error", GREEN),
    ];
    let points = |runs: &[Run], what: &str, field: &str| -> Vec<(f64, f64)> {
        runs.iter()
            .filter_map(|r| r.probes.last().map(|p| (r.params, over_kinds(&p.1, what, field).0)))
            .collect()
    };
    let worst = |runs: &[Run]| -> Vec<(f64, f64)> {
        runs.iter()
            .filter_map(|r| r.probes.last().map(|p| (r.params, over_kinds(&p.1, "grad", "rel_norm_error").2)))
            .collect()
    };
    let mut all: Vec<(f64, f64)> =
        series.iter().flat_map(|s| [points(runs, s.1, s.2), points(engine, s.1, s.2)].concat()).collect();
    all.extend(worst(runs).into_iter().chain(worst(rotated)).chain(worst(unrotated)));
    let lo = all.iter().map(|p| p.1).fold(f64::INFINITY, f64::min) / 2.0;
    let hi = all.iter().map(|p| p.1).fold(0.0, f64::max) * 2.0;
    let x0 = all.iter().map(|p| p.0).fold(f64::INFINITY, f64::min) / 2.0;
    let x1 = all.iter().map(|p| p.0).fold(0.0, f64::max) * 2.0;
    let area = SVGBackend::new(path, (760, 460)).into_drawing_area();
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
        let pts = points(runs, what, field);
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(format!("{name}, HF Llama"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled()))).map_err(|x| e(&x))?;
        let pts = points(engine, what, field);
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(DashedLineSeries::new(pts.clone(), 6, 4, color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(format!("{name}, engine GPT"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 6, y)], color.stroke_width(2)));
        chart
            .draw_series(pts.into_iter().map(|p| TriangleMarker::new(p, 4, color.filled())))
            .map_err(|x| e(&x))?;
    }
    for (name, pts, dash) in [
        ("qgZ gradient, worst kind, HF Llama", worst(runs), None),
        ("the same, every group rotated", worst(rotated), Some((2, 4))),
        ("the same, unrotated", worst(unrotated), Some((8, 3))),
    ] {
        if pts.is_empty() {
            continue;
        }
        let color = MAGENTA;
        let line = match dash {
            None => chart.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2))),
            Some((on, off)) => {
                chart.draw_series(DashedLineSeries::new(pts.clone(), on, off, color.stroke_width(2)))
            }
        };
        line.map_err(|x| e(&x))?
            .label(name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
        chart
            .draw_series(pts.into_iter().map(|p| Cross::new(p, 4, color.stroke_width(2))))
            .map_err(|x| e(&x))?;
    }
    crate::plot::legend_and_present(&mut chart, &area).map_err(|x| e(&x))
}
