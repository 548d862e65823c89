//! The fidelity bench (`cargo xtask bench fidelity`): validation loss of ZeRO++
//! variants relative to ZeRO-3 (bf16, hierarchical), paired per seed, over
//! several corpora, learning rates and seeds, because one seed proves nothing at
//! this scale.
//!
//! For each corpus, learning rate, variant and seed it trains the default GPT on
//! 8 ranks (2 nodes × 4) with the thread backend, as `zeropp train` does, and
//! records the final validation loss. For every variant it reports the per-seed
//! ratio `val_loss(variant) / val_loss(ZeRO-3)` for the same seed, and over the
//! seeds: the mean, its standard error, the median, the worst seed, and whether
//! the variant meets the **two-sided acceptance rule** for a default
//! (`zeropp_tests::fidelity::CALM`, the rule the CI check applies): mean within
//! [0.97, 1.01], every seed within [0.94, 1.03]. ZeRO-3's own seed-to-seed spread
//! is given too: it is the scale of the chaos the ratios have to beat; the rule
//! means something only where that spread is a few percent (lr 3e-3 here).
//!
//! ```text
//! cargo run --release -p zeropp-run --example fidelity -- \
//!     [--seeds 8] [--steps 1500] [--lrs 3e-3[,1e-2]] [--variants core|all|NAME,NAME] \
//!     [--data generated,shakespeare,FILE,...] [--eval-batches 16] [--out FILE.md] \
//!     [--model PRESET] [--seq N] [--width D] [--json FILE.json]
//! ```
//!
//! `--model` trains one of `GptConfig::presets` instead of the default GPT;
//! `--seq` replaces its context and `--width D` its width (with heads of 16,
//! after `--model`); `--json` also writes every seed's losses:
//! per corpus and learning rate, per variant, the validation loss at the end
//! and the training loss at 25%, 50% and 100% of the run (the mean over the
//! 5% of the steps up to each mark), which `cargo xtask bench fidelity-size`
//! reads for the engine's loss against model size.
//!
//! `--data` takes `generated` (the default corpus of `zeropp train`),
//! `shakespeare` (`../shared/data/tinyshakespeare.txt` relative to the workspace
//! root; skipped with a message when absent) and text files by path. `cargo
//! xtask bench fidelity` adds a third English corpus: the first 120,000
//! characters of the Python language reference that ships with CPython
//! (`pydoc_data.topics`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench driver: failures abort

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;
use zeropp_engine::RunConfig;

use zeropp_engine::config::{
    AdamWConfig, CommDtype, DeltaConfig, EngineConfig, HpzWire, LocoConfig, QgzConfig, QuantSpec, ZeroConfig,
    quant_spec,
};
use zeropp_engine::data::DataChoice;
use zeropp_engine::model::GptConfig;
use zeropp_run::train::{ModelChoice, TrainConfig, train};

const LOCAL: usize = 4;
const WORLD: usize = 8;

use zeropp_tests::fidelity::CALM;

/// The symmetric spec of `bits` with `group` elements per scale (the fixed,
/// valid sizes below).
fn spec(bits: u8, group: usize) -> QuantSpec {
    quant_spec("fidelity", bits, group).unwrap_or_else(|e| panic!("{e}"))
}

/// `(name, what it is, config)`.
fn variants() -> Vec<(&'static str, &'static str, ZeroConfig)> {
    let z3 = ZeroConfig::zero3();
    // The variants below spell out their options on the plain ZeRO++ (the
    // paper's three techniques), whatever ZeroConfig::zeropp's defaults are.
    let zpp = ZeroConfig::zeropp_plain(LOCAL);
    // zpp's qgZ (plain INT4) with `f` applied.
    let qgz = |f: fn(&mut QgzConfig)| {
        let mut q = QgzConfig::default();
        f(&mut q);
        Some(q)
    };
    vec![
        (
            "zero3-f32",
            "ZeRO-3, f32 communication (exact; the control)",
            ZeroConfig { comm_dtype: CommDtype::F32, ..z3 },
        ),
        ("zero3", "ZeRO-3, bf16 (the baseline)", z3),
        (
            "default",
            "ZeRO++ as `zeropp train` runs it (ZeroConfig::zeropp: 1-D exclusion, stochastic rounding in qgZ, no feedback)",
            ZeroConfig::zeropp(LOCAL),
        ),
        ("qwz", "qwZ alone (INT8 weights, groups of 256)", z3.with_qwz(ZeroConfig::default_qwz_spec())),
        ("hpz", "hpZ alone", z3.with_hpz(LOCAL)),
        ("qgz", "qgZ alone (INT4 gradients)", z3.with_qgz(QgzConfig::default())),
        ("zeropp", "ZeRO++: qwZ + hpZ + qgZ, no LoCo, no 1-D exclusion", zpp),
        (
            "zeropp-loco",
            "ZeRO++ + LoCo (err_beta 0.8)",
            ZeroConfig { qgz: qgz(|q| q.error_feedback = Some(LocoConfig::default())), ..zpp },
        ),
        (
            "zeropp-1d",
            "ZeRO++ + 1-D params at bf16 under qgZ",
            ZeroConfig { qgz: qgz(|q| q.exclude_1d = true), ..zpp },
        ),
        (
            "zeropp-loco-1d",
            "ZeRO++ + LoCo + 1-D exclusion (the default before issue 18)",
            ZeroConfig {
                qgz: qgz(|q| {
                    q.error_feedback = Some(LocoConfig::default());
                    q.exclude_1d = true;
                }),
                ..zpp
            },
        ),
        (
            "zeropp-ef-1d",
            "ZeRO++ + plain error feedback (β 0) + 1-D exclusion",
            ZeroConfig {
                qgz: qgz(|q| {
                    q.error_feedback = Some(LocoConfig { err_beta: 0.0, ..LocoConfig::default() });
                    q.exclude_1d = true;
                }),
                ..zpp
            },
        ),
        (
            "zeropp-sr-1d",
            "ZeRO++ + stochastic rounding in qwZ and qgZ + 1-D exclusion, no feedback",
            ZeroConfig { stochastic_rounding: true, qgz: qgz(|q| q.exclude_1d = true), ..zpp },
        ),
        (
            "zeropp-loco-1d-f32",
            "ZeRO++ + LoCo with f32 residuals + 1-D exclusion",
            ZeroConfig {
                qgz: qgz(|q| {
                    q.error_feedback = Some(LocoConfig {
                        residual_dtype: zeropp_engine::config::ResidualPrecision::F32,
                        ..LocoConfig::default()
                    });
                    q.exclude_1d = true;
                }),
                ..zpp
            },
        ),
        (
            "zeropp-sr-loco-1d",
            "ZeRO++ + stochastic rounding + LoCo + 1-D exclusion",
            ZeroConfig {
                stochastic_rounding: true,
                qgz: qgz(|q| {
                    q.error_feedback = Some(LocoConfig::default());
                    q.exclude_1d = true;
                }),
                ..zpp
            },
        ),
        ("zeropp-hpz8", "ZeRO++ with the INT8 hpZ wire", ZeroConfig { hpz_wire: HpzWire::Int8, ..zpp }),
        ("zeropp-sr", "ZeRO++ + stochastic rounding", ZeroConfig { stochastic_rounding: true, ..zpp }),
        (
            "zeropp-packed",
            "ZeRO++, groups straddling tensors (the old layout)",
            ZeroConfig { per_tensor_groups: false, ..zpp },
        ),
        ("qwz-g8k", "qwZ alone, groups of 8192 (DeepSpeed's size)", z3.with_qwz(spec(8, 8192))),
        ("zeropp-qgz8", "ZeRO++ with INT8 qgZ", ZeroConfig { qgz: qgz(|q| q.spec = spec(8, 256)), ..zpp }),
        // Beyond ZeRO++ (SDP4Bit's techniques), on the default ZeRO++ above.
        (
            "zeropp-delta",
            "ZeroConfig::zeropp_delta: the defaults + qwZ-delta + two-level qgZ + Hadamard",
            ZeroConfig::zeropp_delta(LOCAL),
        ),
        (
            "delta",
            "the defaults + qwZ-delta alone (refresh every 100)",
            ZeroConfig { qwz_delta: Some(DeltaConfig::default()), ..ZeroConfig::zeropp(LOCAL) },
        ),
        (
            "delta-k0",
            "the defaults + qwZ-delta alone, never refreshed but at the first step",
            ZeroConfig {
                qwz_delta: Some(DeltaConfig { refresh_every: 0, ..DeltaConfig::default() }),
                ..ZeroConfig::zeropp(LOCAL)
            },
        ),
        (
            "delta-k10",
            "the defaults + qwZ-delta alone, refreshed every 10 steps",
            ZeroConfig {
                qwz_delta: Some(DeltaConfig { refresh_every: 10, ..DeltaConfig::default() }),
                ..ZeroConfig::zeropp(LOCAL)
            },
        ),
        ("two-level", "the defaults + two-level qgZ alone (INT8 intra, INT4 inter)", {
            let mut z = ZeroConfig::zeropp(LOCAL);
            z.qgz = z.qgz.map(|q| QgzConfig { two_level: true, ..q });
            z
        }),
        ("hadamard", "the defaults + Hadamard smoothing alone (INT4 both hops)", {
            let mut z = ZeroConfig::zeropp(LOCAL);
            z.qgz = z.qgz.map(|q| QgzConfig { hadamard: true, ..q });
            z
        }),
    ]
}

/// The variants `--variants core` runs: the defaults, old and new, and the
/// candidates for a default.
const CORE: &[&str] = &["zero3", "default", "zeropp-loco-1d", "zeropp-1d", "zeropp-sr-1d"];

struct Args {
    /// The GPT trained, and its name.
    model: (String, GptConfig),
    json: Option<PathBuf>,
    seeds: usize,
    steps: usize,
    lrs: Vec<f32>,
    variants: Vec<String>,
    data: Vec<String>,
    eval_batches: usize,
    out: Option<PathBuf>,
}

fn parse_args() -> Args {
    let mut a = Args {
        model: ("gpt".into(), GptConfig::default_small()),
        json: None,
        seeds: 8,
        steps: 1500,
        lrs: vec![3e-3],
        variants: Vec::new(),
        data: vec!["generated".into(), "shakespeare".into()],
        eval_batches: 16,
        out: None,
    };
    let mut sel = "core".to_string();
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--seeds" => a.seeds = v().parse().expect("--seeds N"),
            "--steps" => a.steps = v().parse().expect("--steps N"),
            "--lrs" => a.lrs = v().split(',').map(|x| x.parse().expect("--lrs X,Y")).collect(),
            "--variants" => sel = v(),
            "--data" => a.data = v().split(',').map(str::to_string).collect(),
            "--eval-batches" => a.eval_batches = v().parse().expect("--eval-batches N"),
            "--out" => a.out = Some(PathBuf::from(v())),
            "--json" => a.json = Some(PathBuf::from(v())),
            "--model" => {
                let name = v();
                let g = GptConfig::preset(&name).unwrap_or_else(|| {
                    let known: Vec<&str> = GptConfig::presets().iter().map(|p| p.0).collect();
                    panic!("--model {name}: not a preset; known: {known:?}")
                });
                a.model = (name, g);
            }
            "--seq" => a.model.1.seq_len = v().parse().expect("--seq N"),
            "--width" => {
                let d: usize = v().parse().expect("--width N");
                assert!(
                    d.is_multiple_of(16) && d > 0,
                    "--width {d}: a positive multiple of 16 (heads of 16)"
                );
                a.model.0 = format!("{}, width {d}", a.model.0);
                a.model.1 = GptConfig { d_model: d, n_head: d / 16, ..a.model.1 };
            }
            "--bench" => {} // passed by `cargo bench`-style drivers; ignored
            other => panic!("unknown argument {other}; see the example's docs"),
        }
    }
    let all: Vec<&str> = variants().iter().map(|v| v.0).collect();
    a.variants = match sel.as_str() {
        "core" => CORE.iter().map(|s| s.to_string()).collect(),
        "all" => all.iter().map(|s| s.to_string()).collect(),
        list => {
            let mut v: Vec<String> = list.split(',').map(str::to_string).collect();
            for name in &v {
                assert!(all.contains(&name.as_str()), "unknown variant {name}; known: {all:?}");
            }
            if !v.iter().any(|n| n == "zero3") {
                v.insert(0, "zero3".into());
            }
            v
        }
    };
    a
}

/// The fractions of the run at which `--json` gives the training loss.
const MARKS: [f64; 3] = [0.25, 0.5, 1.0];

/// The mean training loss over the 5% of `steps` (at least one) that end at
/// `mark` of the run.
fn train_loss_at(steps: &[zeropp_engine::metrics::StepRecord], mark: f64) -> f64 {
    let end = ((steps.len() as f64 * mark).round() as usize).clamp(1, steps.len().max(1));
    let start = end.saturating_sub((steps.len() / 20).max(1));
    let w = &steps[start..end.min(steps.len())];
    w.iter().map(|s| f64::from(s.loss)).sum::<f64>() / w.len().max(1) as f64
}

/// Mean, standard error of the mean, median and maximum of `xs`.
fn stats(xs: &[f64]) -> (f64, f64, f64, f64) {
    let n = xs.len() as f64;
    let m = xs.iter().sum::<f64>() / n;
    let se = if xs.len() < 2 {
        f64::NAN
    } else {
        (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0) / n).sqrt()
    };
    let mut s = xs.to_vec();
    s.sort_by(f64::total_cmp);
    let med = if s.len() % 2 == 1 { s[s.len() / 2] } else { (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0 };
    (m, se, med, s.last().copied().unwrap_or(f64::NAN))
}

/// The corpora named by `--data`, with their labels.
fn corpora(names: &[String]) -> Vec<(String, DataChoice)> {
    let mut out = Vec::new();
    for name in names {
        match name.as_str() {
            "generated" => out.push((
                "generated Markov text (`zeropp train`'s default corpus)".to_string(),
                DataChoice::Markov { seed: 0, chars: 200_000 },
            )),
            "shakespeare" => match zeropp_tests::data::find(zeropp_tests::data::TINYSHAKESPEARE) {
                Some(p) => out.push(("tinyshakespeare".to_string(), DataChoice::File(p))),
                None => eprintln!(
                    "fidelity: skipping tinyshakespeare: ../shared/data/tinyshakespeare.txt is absent"
                ),
            },
            path => {
                let p = PathBuf::from(path);
                assert!(p.is_file(), "fidelity: --data {path}: no such file");
                let label = p.file_name().map_or(path.to_string(), |f| f.to_string_lossy().into_owned());
                out.push((label, DataChoice::File(p)));
            }
        }
    }
    out
}

fn main() {
    let args = parse_args();
    let table = variants();
    let mut report = String::new();
    let _ = writeln!(
        report,
        "# Fidelity: validation loss relative to ZeRO-3 (bf16, hierarchical)\n\n\
         GPT `{}`, context {} ({} params at a 64-character vocabulary), {WORLD} ranks as {} nodes x {LOCAL}, \
         {} steps, global batch 16, seeds 1..={}, {} validation batches. Ratio = val_loss(variant) / \
         val_loss(ZeRO-3) for the same seed. Per variant: mean over seeds, its standard error, median, \
         worst seed, seeds on which it is worse than ZeRO-3, and the acceptance rule for a default \
         (two-sided: mean in {:?}, every seed in {:?}).\n",
        args.model.0,
        args.model.1.seq_len,
        zeropp_engine::model::Gpt::new(args.model.1.with_vocab(64)).map(|g| g.num_params()).unwrap_or(0),
        WORLD / LOCAL,
        args.steps,
        args.seeds,
        args.eval_batches,
        CALM.mean,
        CALM.seed,
    );
    let mut json_runs = Vec::new();
    for (corpus, data) in &corpora(&args.data) {
        for &lr in &args.lrs {
            let started = Instant::now();
            let mut losses: Vec<(String, Vec<f64>)> = Vec::new();
            let mut json_variants = serde_json::Map::new();
            for name in &args.variants {
                let (_, _, zero) = table.iter().find(|v| v.0 == name).copied().expect("known variant");
                let mut per_seed = Vec::new();
                let mut train_at: [Vec<f64>; 3] = Default::default();
                for seed in 1..=args.seeds as u64 {
                    let cfg = TrainConfig {
                        model: ModelChoice::Gpt(args.model.1),
                        data: data.clone(),
                        run: RunConfig {
                            world: WORLD,
                            local_size: LOCAL,
                            engine: EngineConfig {
                                zero,
                                global_batch: 16,
                                optim: AdamWConfig { lr, ..AdamWConfig::default() },
                                seed,
                                ..EngineConfig::default()
                            },
                            steps: args.steps,
                            eval_batches: args.eval_batches,
                            ..RunConfig::default()
                        },
                    };
                    let r =
                        train(&cfg).unwrap_or_else(|e| panic!("{corpus} lr {lr} {name} seed {seed}: {e}"));
                    let v = f64::from(r.summary.val_loss.expect("validation ran"));
                    eprintln!("fidelity: {corpus} lr {lr} {name:>18} seed {seed}: val loss {v:.4}");
                    per_seed.push(v);
                    for (at, mark) in train_at.iter_mut().zip(MARKS) {
                        at.push(train_loss_at(&r.steps, mark));
                    }
                }
                let marks: serde_json::Map<String, serde_json::Value> =
                    MARKS.iter().zip(&train_at).map(|(m, v)| (m.to_string(), serde_json::json!(v))).collect();
                json_variants.insert(name.clone(), serde_json::json!({"val": per_seed, "train_at": marks}));
                losses.push((name.clone(), per_seed));
            }
            let base = losses.iter().find(|(n, _)| n == "zero3").map(|(_, v)| v.clone()).expect("zero3 ran");
            let (bm, bse, _, _) = stats(&base);
            let sd = bse * (base.len() as f64).sqrt();
            let spread =
                base.iter().cloned().fold(f64::MIN, f64::max) / base.iter().cloned().fold(f64::MAX, f64::min);
            let _ = writeln!(
                report,
                "## {corpus}, lr {lr}\n\nZeRO-3's own val loss over the seeds: mean {bm:.4}, sd {sd:.4} \
                 ({:.1}% of the mean), max/min {spread:.3}. ({:.0} s)\n\n\
                 | variant | what | mean ratio | std. error | median | worst seed | worse on | rule | per seed |\n\
                 |---|---|---|---|---|---|---|---|---|",
                100.0 * sd / bm,
                started.elapsed().as_secs_f64()
            );
            for (name, v) in &losses {
                if name == "zero3" {
                    continue;
                }
                let what = table.iter().find(|x| x.0 == name).map_or("", |x| x.1);
                let ratios: Vec<f64> = v.iter().zip(&base).map(|(a, b)| a / b).collect();
                let (m, se, med, worst) = stats(&ratios);
                let worse = ratios.iter().filter(|&&r| r > 1.0).count();
                let judged = CALM.judge(&ratios);
                let pass = if judged.passed() {
                    "meets".to_string()
                } else {
                    format!("fails: {}", judged.broken.join("; "))
                };
                let per: Vec<String> = ratios.iter().map(|r| format!("{r:.3}")).collect();
                let _ = writeln!(
                    report,
                    "| {name} | {what} | {m:.4} | {se:.4} | {med:.4} | {worst:.4} | {worse}/{} | {pass} | {} |",
                    ratios.len(),
                    per.join(" ")
                );
            }
            report.push('\n');
            let params = zeropp_engine::data::load_data(data)
                .ok()
                .and_then(|(_, info)| {
                    zeropp_engine::model::Gpt::new(args.model.1.with_vocab(info.vocab)).ok()
                })
                .map_or(0, |g| g.num_params());
            json_runs.push(serde_json::json!({
                "corpus": corpus, "lr": lr, "params": params, "variants": json_variants,
            }));
            if let Some(path) = &args.json {
                let v = serde_json::json!({
                    "model": args.model.0, "seq": args.model.1.seq_len, "steps": args.steps,
                    "seeds": args.seeds, "runs": json_runs,
                });
                std::fs::write(path, serde_json::to_string_pretty(&v).expect("JSON")).expect("write --json");
            }
            // Progress: the report so far, in case a long run is interrupted.
            if let Some(out) = &args.out {
                if let Some(dir) = out.parent() {
                    std::fs::create_dir_all(dir).expect("create the report folder");
                }
                std::fs::write(out, &report).expect("write the report");
            }
        }
    }
    print!("{report}");
    if let Some(out) = &args.out {
        eprintln!("fidelity: report written to {}", out.display());
    }
}
