//! The fidelity bench (`cargo xtask bench fidelity`): validation loss of every
//! ZeRO++ variant relative to ZeRO-3 (bf16, hierarchical) over several seeds and
//! two corpora, because one seed proves nothing at this scale.
//!
//! For each corpus, variant and seed it trains the default GPT on 8 ranks (2
//! nodes × 4) with the thread backend and records the final validation loss. It
//! reports per variant: the mean over seeds of `val_loss(variant) / val_loss(ZeRO-3)`
//! for the same seed, its standard error, the paired sign count (seeds on which
//! the variant is worse), and, for ZeRO-3 itself, the seed-to-seed spread of its
//! validation loss (the scale of the chaos the ratios have to beat).
//!
//! ```text
//! cargo run --release -p zeropp-engine --example fidelity -- \
//!     [--seeds 5] [--steps 1000] [--variants core|all|NAME,NAME] [--data generated|shakespeare|both] [--out FILE.md]
//! ```
//!
//! tinyshakespeare is read from `../shared/data/tinyshakespeare.txt` (relative to
//! the workspace root); without it that corpus is skipped with a message.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench driver: failures abort

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use zeropp_engine::config::{
    AdamWConfig, CommDtype, EngineConfig, HpzWire, LocoConfig, QgzConfig, QuantSpec, ZeroConfig, quant_spec,
};
use zeropp_engine::model::GptConfig;
use zeropp_engine::train::{DataChoice, ModelChoice, TrainConfig, train};

const LOCAL: usize = 4;
const WORLD: usize = 8;

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
        ("zero3-f32", "ZeRO-3, f32 communication (exact)", ZeroConfig { comm_dtype: CommDtype::F32, ..z3 }),
        ("zero3", "ZeRO-3, bf16 (the baseline)", z3),
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
        ("zeropp-hpz8", "ZeRO++ with the INT8 hpZ wire", ZeroConfig { hpz_wire: HpzWire::Int8, ..zpp }),
        ("zeropp-sr", "ZeRO++ + stochastic rounding", ZeroConfig { stochastic_rounding: true, ..zpp }),
        (
            "zeropp-loco-1d",
            "ZeRO++ + LoCo + 1-D exclusion (the default since this bench)",
            ZeroConfig {
                qgz: qgz(|q| {
                    q.error_feedback = Some(LocoConfig::default());
                    q.exclude_1d = true;
                }),
                ..zpp
            },
        ),
        (
            "zeropp-packed",
            "ZeRO++, groups straddling tensors (the old layout)",
            ZeroConfig { per_tensor_groups: false, ..zpp },
        ),
        ("qwz-g8k", "qwZ alone, groups of 8192 (DeepSpeed's size)", z3.with_qwz(spec(8, 8192))),
        ("zeropp-qgz8", "ZeRO++ with INT8 qgZ", ZeroConfig { qgz: qgz(|q| q.spec = spec(8, 256)), ..zpp }),
    ]
}

const CORE: &[&str] = &[
    "zero3-f32",
    "zero3",
    "qwz",
    "hpz",
    "qgz",
    "zeropp",
    "zeropp-loco",
    "zeropp-1d",
    "zeropp-hpz8",
    "zeropp-loco-1d",
];

fn shakespeare() -> Option<PathBuf> {
    zeropp_tests::data::find(zeropp_tests::data::TINYSHAKESPEARE)
}

struct Args {
    seeds: usize,
    steps: usize,
    variants: Vec<String>,
    data: String,
    out: Option<PathBuf>,
}

fn parse_args() -> Args {
    let mut a = Args { seeds: 5, steps: 1000, variants: Vec::new(), data: "both".into(), out: None };
    let mut sel = "core".to_string();
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--seeds" => a.seeds = v().parse().expect("--seeds N"),
            "--steps" => a.steps = v().parse().expect("--steps N"),
            "--variants" => sel = v(),
            "--data" => a.data = v(),
            "--out" => a.out = Some(PathBuf::from(v())),
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

fn mean_se(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let m = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (m, f64::NAN);
    }
    let var = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0);
    (m, (var / n).sqrt())
}

fn main() {
    let args = parse_args();
    let mut corpora: Vec<(&str, DataChoice)> = Vec::new();
    if args.data == "generated" || args.data == "both" {
        corpora.push(("generated Markov text (200k chars)", DataChoice::Markov { seed: 0, chars: 200_000 }));
    }
    if args.data == "shakespeare" || args.data == "both" {
        match shakespeare() {
            Some(p) => corpora.push(("tinyshakespeare", DataChoice::File(p))),
            None => {
                eprintln!("fidelity: skipping tinyshakespeare: ../shared/data/tinyshakespeare.txt is absent")
            }
        }
    }
    let table = variants();
    let mut report = String::new();
    let _ = writeln!(
        report,
        "# Fidelity: validation loss relative to ZeRO-3 (bf16, hierarchical)\n\n\
         Default GPT ({} params), {WORLD} ranks as {} nodes x {LOCAL}, {} steps, lr 1e-2, global batch 16, \
         seeds 1..={}, 16 validation batches. Ratio = val_loss(variant) / val_loss(ZeRO-3) for the same seed; \
         mean over seeds, standard error of that mean, and the paired sign count (seeds on which the variant \
         is worse than ZeRO-3).\n",
        zeropp_engine::model::Gpt::new(GptConfig::default_small()).map(|g| g.num_params()).unwrap_or(0),
        WORLD / LOCAL,
        args.steps,
        args.seeds
    );
    for (corpus, data) in &corpora {
        let started = Instant::now();
        let mut losses: Vec<(String, Vec<f64>)> = Vec::new();
        for name in &args.variants {
            let (_, _, zero) = table.iter().find(|v| v.0 == name).copied().expect("known variant");
            let mut per_seed = Vec::new();
            for seed in 1..=args.seeds as u64 {
                let cfg = TrainConfig {
                    model: ModelChoice::Gpt(GptConfig::default_small()),
                    data: data.clone(),
                    world: WORLD,
                    local_size: LOCAL,
                    engine: EngineConfig {
                        zero,
                        global_batch: 16,
                        optim: AdamWConfig { lr: 1e-2, ..AdamWConfig::default() },
                        seed,
                        ..EngineConfig::default()
                    },
                    steps: args.steps,
                    eval_batches: 16,
                    ..TrainConfig::default()
                };
                let r = train(&cfg).unwrap_or_else(|e| panic!("{corpus} {name} seed {seed}: {e}"));
                let v = f64::from(r.summary.val_loss.expect("validation ran"));
                eprintln!("fidelity: {corpus} {name:>15} seed {seed}: val loss {v:.4}");
                per_seed.push(v);
            }
            losses.push((name.clone(), per_seed));
        }
        let base = losses.iter().find(|(n, _)| n == "zero3").map(|(_, v)| v.clone()).expect("zero3 ran");
        let (bm, _) = mean_se(&base);
        let spread =
            base.iter().cloned().fold(f64::MIN, f64::max) / base.iter().cloned().fold(f64::MAX, f64::min);
        let sd = (base.iter().map(|x| (x - bm).powi(2)).sum::<f64>() / (base.len().max(2) - 1) as f64).sqrt();
        let _ = writeln!(
            report,
            "## {corpus}\n\nZeRO-3's own val loss over the seeds: mean {bm:.4}, sd {sd:.4} ({:.2}% of the mean), \
             max/min {spread:.4}. ({:.0} s)\n\n\
             | variant | what | mean ratio | std. error | worse on | per seed |\n|---|---|---|---|---|---|",
            100.0 * sd / bm,
            started.elapsed().as_secs_f64()
        );
        for (name, v) in &losses {
            let what = table.iter().find(|x| x.0 == name).map_or("", |x| x.1);
            let ratios: Vec<f64> = v.iter().zip(&base).map(|(a, b)| a / b).collect();
            let (m, se) = mean_se(&ratios);
            let worse = ratios.iter().filter(|&&r| r > 1.0).count();
            let per: Vec<String> = ratios.iter().map(|r| format!("{r:.4}")).collect();
            let _ = writeln!(
                report,
                "| {name} | {what} | {m:.4} | {se:.4} | {worse}/{} | {} |",
                ratios.len(),
                per.join(" ")
            );
        }
        report.push('\n');
    }
    print!("{report}");
    if let Some(out) = &args.out {
        if let Some(dir) = out.parent() {
            std::fs::create_dir_all(dir).expect("create the report folder");
        }
        std::fs::write(out, &report).expect("write the report");
        eprintln!("fidelity: report written to {}", out.display());
    }
}
