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
use std::path::PathBuf;

use zeropp_comm::collectives::{
    DenseWire, QgzOptions, Reduce, Routing, qgz_reduce_scatter, world_reduce_scatter,
};
use zeropp_comm::{ThreadCluster, ThreadOptions};
use zeropp_engine::Model;
use zeropp_engine::config::{AdamWConfig, EngineConfig, ZeroConfig};
use zeropp_engine::data::shard;
use zeropp_engine::engine::build_plan;
use zeropp_engine::model::{full_forward_backward, init_params};
use zeropp_engine::optim::{AdamW, clip_factor};
use zeropp_quant::Options;
use zeropp_quant::rng::stream_seed;

mod probe;
use probe::{BATCH, LOCAL, NODES, Setup};

/// `(name, intra-node bits, Hadamard, stochastic rounding)`.
const VARIANTS: [(&str, u8, bool, bool); 6] = [
    ("plain INT4 (ZeRO++'s qgZ)", 4, false, true),
    ("two-level (INT8 intra, INT4 inter)", 8, false, true),
    ("Hadamard (INT4 both hops)", 4, true, true),
    ("two-level + Hadamard (zeropp-delta's qgZ)", 8, true, true),
    ("plain INT4, nearest rounding", 4, false, false),
    ("two-level + Hadamard, nearest rounding", 8, true, false),
];

struct Args {
    data: String,
    steps: usize,
    every: usize,
    seed: u64,
    out: Option<PathBuf>,
}

fn parse_args() -> Args {
    let mut a = Args { data: "generated".into(), steps: 1000, every: 10, seed: 1, out: None };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--data" => a.data = v(),
            "--steps" => a.steps = v().parse().expect("--steps N"),
            "--every" => a.every = v().parse::<usize>().expect("--every N").max(1),
            "--seed" => a.seed = v().parse().expect("--seed N"),
            "--out" => a.out = Some(PathBuf::from(v())),
            "--bench" => {}
            other => panic!("unknown argument {other}; see the example's docs"),
        }
    }
    a
}

/// Squared errors, squared exact values and element counts, per variant and phase.
#[derive(Clone, Default)]
struct Acc {
    err2: f64,
    exact2: f64,
    count: f64,
}

fn main() {
    let args = parse_args();
    let Setup { data, info, model, topology: topo } = probe::setup(&args.data);
    let cfg = EngineConfig { zero: ZeroConfig::zeropp_delta(LOCAL), ..EngineConfig::default() };
    let plan = build_plan(&model, &cfg, topo).expect("plan");
    let optim = AdamWConfig::default();
    let spec = ZeroConfig::default_qgz_spec();
    let g = spec.group_size();
    let w = topo.world();
    let seq = model.config().seq_len;
    let layers = model.layers().len();
    let phases = probe::phases(args.steps);
    eprintln!(
        "qgz error: {} ({} params), {w} ranks = {NODES} x {LOCAL}, {} steps, a sample every {}, seed {}",
        info.description,
        model.num_params(),
        args.steps,
        args.every,
        args.seed
    );
    let cluster = ThreadCluster::new(topo, ThreadOptions::default());
    let per_rank: Vec<Vec<Vec<Acc>>> = cluster
        .run(|comm| {
            let rank = comm.rank();
            let mut params = init_params(&model, args.seed)?;
            let s: Vec<usize> = (0..layers).map(|l| plan.shard_len(l)).collect::<Result<_, _>>()?;
            let mut opt: Vec<AdamW> = s.iter().map(|&n| AdamW::new(optim, n)).collect();
            let mut out = vec![vec![Acc::default(); VARIANTS.len()]; phases.len()];
            for step in 0..args.steps {
                let batch = data.global_batch(step as u64, 0, BATCH, seq, args.seed)?;
                let (_, grads) = full_forward_backward(&model, &params, &shard(&batch, rank, w)?)?;
                let sample = step.is_multiple_of(args.every);
                let ph = phases.iter().position(|&(a, b)| (a..b).contains(&step)).unwrap_or(0);
                let mut exact_all = Vec::with_capacity(layers);
                for l in 0..layers {
                    let b = plan.bucket(l)?;
                    let mut full = vec![0.0f32; b.padded_len];
                    b.expand_into(&grads[l], &mut full)?;
                    let mut exact = vec![0.0f32; s[l]];
                    world_reduce_scatter(
                        comm,
                        Routing::Hierarchical,
                        DenseWire::F32,
                        &full,
                        &mut exact,
                        Reduce::Mean,
                    )?;
                    if sample {
                        // The engine's qgZ input: the 1-D parameters zeroed (they go exact).
                        let mut one_d = vec![false; b.padded_len];
                        for p in b.params.iter().filter(|p| p.shape.len() == 1) {
                            full[p.range()].iter_mut().for_each(|x| *x = 0.0);
                            one_d[p.range()].iter_mut().for_each(|m| *m = true);
                        }
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
                // The exact step: the global norm, clipping, AdamW on every shard,
                // then every rank's full parameters (gathered exactly).
                let sq: f64 = exact_all.iter().flatten().map(|&x| f64::from(x).powi(2)).sum();
                let mut all = vec![0.0f64; w];
                zeropp_comm::CommExt::all_gather(comm, &zeropp_comm::Group::world(&topo), &[sq], &mut all)?;
                let factor = clip_factor(all.iter().sum::<f64>().sqrt() as f32, Some(1.0));
                for l in 0..layers {
                    let b = plan.bucket(l)?;
                    let mut flat = vec![0.0f32; b.padded_len];
                    b.expand_into(&params[l], &mut flat)?;
                    let mut shard_p = flat[rank * s[l]..(rank + 1) * s[l]].to_vec();
                    opt[l].step(&mut shard_p, &exact_all[l], factor)?;
                    let mut gathered = vec![0.0f32; b.padded_len];
                    zeropp_comm::collectives::world_all_gather(
                        comm,
                        Routing::Hierarchical,
                        DenseWire::F32,
                        &shard_p,
                        &mut gathered,
                    )?;
                    params[l] = b.compact(&gathered)?;
                }
            }
            Ok::<_, zeropp_engine::EngineError>(out)
        })
        .expect("the probe's cluster");
    // Sums over ranks.
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# qgZ's error on real gradients: {} ({} params), {w} ranks = {NODES} x {LOCAL}, seed {}\n\n\
         Along the exact trajectory; every {} steps each rank's local gradients go through each variant \
         (groups of {g} per tensor, the 1-D parameters excluded). MSE = mean squared error against the \
         exact mean on the quantized positions; ratio = the variant's MSE / plain INT4's (stochastic).\n",
        info.description,
        model.num_params(),
        args.seed,
        args.every
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
