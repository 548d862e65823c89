//! qgZ's gradient error on real gradients (`cargo xtask bench qgz-error`):
//! SDP4Bit's two levels and Hadamard smoothing against plain INT4, measured on
//! gradients captured from training, not random data.
//!
//! Eight ranks (2 nodes × 4, thread backend) train the default GPT along the
//! exact trajectory (f32 reduce-scatters, AdamW). Every `--every` steps each
//! rank also runs its local gradients through qgZ on the side, once per
//! variant, with the engine's layout (groups of 256 per tensor, the 1-D
//! parameters excluded, as the default sends them exactly) and the engine's
//! stochastic rounding; the reduced gradient `ĝ` is compared with the exact
//! mean `g` on the quantized positions. Reported per phase of training and per
//! variant: the mean squared error `Σ(ĝ − g)² / count` and its ratio to plain
//! INT4's on the same gradients (the issue's figure), and the relative error
//! `‖ĝ − g‖ / ‖g‖`.
//!
//! ```text
//! cargo run --release -p zeropp-engine --example qgz_error -- \
//!     [--data generated|shakespeare|FILE] [--steps 1000] [--every 10] [--seed 1] [--out FILE.md]
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench driver: failures abort

use std::fmt::Write as _;

use zeropp_comm::collectives::{QgzOptions, qgz_reduce_scatter};
use zeropp_engine::config::{AdamWConfig, ZeroConfig};
use zeropp_engine::data::shard;
use zeropp_engine::model::full_forward_backward;
use zeropp_engine::optim::AdamW;
use zeropp_quant::Options;
use zeropp_quant::rng::stream_seed;

mod probe;
use probe::{BATCH, LOCAL, Setup};

/// `(name, intra-node bits, Hadamard, stochastic rounding)`.
const VARIANTS: [(&str, u8, bool, bool); 6] = [
    ("plain INT4 (ZeRO++'s qgZ)", 4, false, true),
    ("two-level (INT8 intra, INT4 inter)", 8, false, true),
    ("Hadamard (INT4 both hops)", 4, true, true),
    ("two-level + Hadamard (zeropp-delta's qgZ)", 8, true, true),
    ("plain INT4, nearest rounding", 4, false, false),
    ("two-level + Hadamard, nearest rounding", 8, true, false),
];

/// Squared errors, squared exact values and element counts, per variant and phase.
#[derive(Clone, Default)]
struct Acc {
    err2: f64,
    exact2: f64,
    count: f64,
}

fn main() {
    let mut every = 10usize;
    let args = probe::parse_args(1000, |flag, v| {
        let known = flag == "--every";
        if known {
            every = v.parse::<usize>().expect("--every N").max(1);
        }
        known
    });
    let setup = probe::setup(&args.data, ZeroConfig::zeropp_delta(LOCAL));
    let Setup { data, model, plan, cfg, banner, .. } = &setup;
    let (w, seq, layers) = (setup.world, setup.seq, setup.layers);
    let optim = AdamWConfig::default();
    let spec = ZeroConfig::default_qgz_spec();
    let g = spec.group_size();
    let phases = probe::phases(args.steps);
    eprintln!("qgz error: {banner}, {} steps, a sample every {}, seed {}", args.steps, every, args.seed);
    let per_rank: Vec<Vec<Vec<Acc>>> = probe::on_ranks(&setup, args.seed, |comm, mut params, s| {
        let rank = comm.rank();
        let mut opt: Vec<AdamW> = s.iter().map(|&n| AdamW::new(optim, n)).collect();
        let mut out = vec![vec![Acc::default(); VARIANTS.len()]; phases.len()];
        for step in 0..args.steps {
            let batch = data.global_batch(step as u64, 0, BATCH, seq, args.seed)?;
            let (_, grads) = full_forward_backward(model, &params, &shard(&batch, rank, w)?)?;
            let sample = step.is_multiple_of(every);
            let ph = phases.iter().position(|&(a, b)| (a..b).contains(&step)).unwrap_or(0);
            let mut exact_all = Vec::with_capacity(layers);
            for l in 0..layers {
                let (mut full, exact) = probe::exact_mean(comm, plan, l, &grads[l])?;
                if sample {
                    // The engine's qgZ input: the 1-D parameters zeroed (they go exact).
                    let one_d = probe::one_d_mask(plan.bucket(l)?);
                    full.iter_mut().zip(&one_d).filter(|(_, m)| **m).for_each(|(x, _)| *x = 0.0);
                    let mine = &one_d[rank * s[l]..(rank + 1) * s[l]];
                    for (v, &(_, intra, hadamard, stochastic)) in VARIANTS.iter().enumerate() {
                        let mut o = QgzOptions::default().with_spec(spec);
                        if intra == 8 {
                            o = QgzOptions::two_level(g)?;
                        }
                        let keys = [step as u64, l as u64];
                        if hadamard {
                            o = o.with_hadamard(stream_seed(args.seed ^ 0x4844, &keys));
                        }
                        if stochastic {
                            o.quant = Options::default().stochastic(stream_seed(args.seed, &keys));
                        }
                        let mut got = vec![0.0f32; s[l]];
                        qgz_reduce_scatter(comm, &full, &mut got, &o)?;
                        let acc = &mut out[ph][v];
                        for ((a, e), skip) in got.iter().zip(&exact).zip(mine) {
                            if !skip {
                                acc.err2 += (f64::from(*a) - f64::from(*e)).powi(2);
                                acc.exact2 += f64::from(*e).powi(2);
                                acc.count += 1.0;
                            }
                        }
                    }
                }
                exact_all.push(exact);
            }
            probe::exact_step(comm, plan, cfg.gradient_clipping, &mut opt, &mut params, &exact_all)?;
        }
        Ok(out)
    });
    // Sums over ranks.
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# qgZ's error on real gradients: {banner}, seed {}\n\n\
         Along the exact trajectory; every {} steps each rank's local gradients go through each variant \
         (groups of {g} per tensor, the 1-D parameters excluded). MSE = mean squared error against the \
         exact mean on the quantized positions; ratio = the variant's MSE / plain INT4's (stochastic).\n",
        args.seed, every
    );
    for (ph, &(a, b)) in phases.iter().enumerate() {
        let _ = writeln!(
            md,
            "## steps {a}..{b}\n\n| variant | MSE | MSE / plain INT4 | ‖ĝ − g‖ / ‖g‖ |\n|---|---|---|---|"
        );
        let sum = |v: usize| {
            per_rank.iter().fold(Acc::default(), |mut t, r| {
                t.err2 += r[ph][v].err2;
                t.exact2 += r[ph][v].exact2;
                t.count += r[ph][v].count;
                t
            })
        };
        let base = sum(0);
        for (v, (name, ..)) in VARIANTS.iter().enumerate() {
            let t = sum(v);
            let _ = writeln!(
                md,
                "| {name} | {:.3e} | {:.3} | {:.4} |",
                t.err2 / t.count.max(1.0),
                t.err2 / base.err2.max(f64::MIN_POSITIVE),
                (t.err2 / t.exact2.max(f64::MIN_POSITIVE)).sqrt()
            );
        }
        md.push('\n');
    }
    print!("{md}");
    if let Some(out) = &args.out {
        std::fs::write(out, &md).expect("write the report");
        eprintln!("qgz error: report written to {}", out.display());
    }
}
