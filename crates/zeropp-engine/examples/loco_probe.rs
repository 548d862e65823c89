//! The error-feedback probe (`cargo xtask bench loco-probe`): what qgZ's error
//! feedback does to the gradient and to the AdamW update, measured along one
//! exact training trajectory.
//!
//! Eight ranks (2 nodes × 4, thread backend) train the default GPT with exact
//! f32 gradient reduce-scatters; that is the trajectory. At every step and layer
//! each rank also runs the same local gradients through qgZ on the side, in
//! three variants: no error feedback, plain error feedback (β = 0) and LoCo
//! (β = 0.8, reset every 1024 steps), each with its own residuals, and the 1-D
//! parameters exact as the default excludes them. Each variant's reduced
//! gradient `ĝ` feeds a shadow AdamW whose update `û` is compared with the
//! update `u` of an AdamW fed the exact gradient `g`, from the same parameters.
//! Because the trajectory is shared, the figures are free of the chaos that
//! makes two training runs diverge; they isolate what the reduction does.
//!
//! Reported per phase of training and per variant (sums over ranks, layers,
//! steps in the phase):
//!
//! - `grad err`: `‖ĝ − g‖ / ‖g‖`, the per-step error of the reduced gradient;
//! - `grad drift`: `‖Σ(ĝ − g)‖ / ‖Σ g‖` over the phase, the error left after
//!   averaging over steps (what error feedback is built to remove);
//! - `update err`: `‖û − u‖ / ‖u‖`, the per-step error of the AdamW update;
//! - `|û|/|u|`: the size of the update against the exact one;
//! - `sign`: the fraction of coordinates whose update has the exact sign;
//! - `zeroed`: the fraction of coordinates the exact gradient moves (`g ≠ 0`)
//!   that receive `ĝ = 0` (INT4 rounds them away).
//!
//! Each figure is given for AdamW's `β2` of the run (0.95 by default) and, with a
//! second pair of shadow optimizers, for `β2 = 0.999`, to show how the update
//! error depends on how long AdamW remembers the squared gradient.
//!
//! ```text
//! cargo run --release -p zeropp-engine --example loco_probe -- \
//!     [--data generated|shakespeare|FILE] [--steps 1500] [--seed 1] [--lr 3e-3] [--follow INDEX] [--out FILE.md]
//! ```
//!
//! `--follow INDEX` drives the trajectory with variant INDEX's updates (0-4, in
//! the table's order) instead of the exact ones, and prints the training loss
//! per phase and the final validation loss of that trajectory.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench driver: failures abort
#![allow(clippy::needless_range_loop)] // layer indices walk several per-layer vectors at once

use std::fmt::Write as _;

use zeropp_comm::CommExt;
use zeropp_comm::collectives::{
    DenseWire, ErrorFeedback, QgzOptions, Routing, qgz_reduce_scatter, qgz_reduce_scatter_with_feedback,
    world_all_gather,
};
use zeropp_engine::config::{AdamWConfig, QuantSpec, ZeroConfig};
use zeropp_engine::data::shard;
use zeropp_engine::model::full_forward_backward;
use zeropp_engine::optim::{AdamW, clip_factor};
use zeropp_quant::Options;
use zeropp_quant::rng::stream_seed;

mod probe;
use probe::{BATCH, LOCAL, Setup};

/// The reductions compared with the exact one.
/// `(name, error feedback β, stochastic rounding)`.
const VARIANTS: [(&str, Option<f32>, bool); 5] = [
    ("nearest, no feedback", None, false),
    ("nearest, plain EF (β 0)", Some(0.0), false),
    ("nearest, LoCo (β 0.8)", Some(0.8), false),
    ("stochastic, no feedback", None, true),
    ("stochastic, LoCo (β 0.8)", Some(0.8), true),
];
const LOCO_RESET: usize = 1024;
/// AdamW β2 of the second pair of shadow optimizers.
const LONG_BETA2: f32 = 0.999;

/// Sums of one variant over a phase (one rank's share; ranks are summed at the end).
#[derive(Debug, Clone, Default)]
struct Acc {
    /// `Σ‖ĝ − g‖²`, `Σ‖g‖²`.
    gerr: f64,
    gnorm: f64,
    /// `Σ‖û − u‖²`, `Σ‖u‖²`, `Σ‖û‖²` for [run β2, long β2].
    uerr: [f64; 2],
    unorm: [f64; 2],
    uhat: [f64; 2],
    /// Coordinates whose update has the exact sign, coordinates counted.
    sign_ok: [f64; 2],
    coords: f64,
    /// Coordinates with `g ≠ 0` and `ĝ = 0`, coordinates with `g ≠ 0`.
    zeroed: f64,
    moved: f64,
    /// `Σ(ĝ − g)` and `Σ g` over the phase, per layer (flattened shards).
    drift: Vec<Vec<f64>>,
    sum_g: Vec<Vec<f64>>,
    /// Sum of this rank's training losses over the phase, and steps.
    loss: f64,
    steps: f64,
    /// `Σ û` and `Σ u` over the phase (run β2), per layer.
    sum_uh: Vec<Vec<f64>>,
    sum_u: Vec<Vec<f64>>,
}

fn main() {
    let (mut lr, mut follow) = (3e-3f32, None::<usize>);
    let args = probe::parse_args(1500, |flag, v| {
        match flag {
            "--lr" => lr = v.parse().expect("--lr X"),
            "--follow" => {
                let i: usize = v.parse().expect("--follow INDEX");
                assert!(i < VARIANTS.len(), "--follow takes a variant index below {}", VARIANTS.len());
                follow = Some(i);
            }
            _ => return false,
        }
        true
    });
    let setup = probe::setup(&args.data, ZeroConfig::zeropp(LOCAL));
    let Setup { data, model, plan, cfg, banner, .. } = &setup;
    let (topo, w, seq, layers) = (setup.topology, setup.world, setup.seq, setup.layers);
    let optim = AdamWConfig { lr, ..AdamWConfig::default() };
    let long = AdamWConfig { beta2: LONG_BETA2, ..optim };
    let spec = ZeroConfig::default_qgz_spec();
    let local_spec = QuantSpec::int8(spec.group_size()).expect("int8 spec");
    let qgz = QgzOptions { intra_spec: spec, inter_spec: spec, local_spec, ..QgzOptions::default() };
    let phases = probe::phases(args.steps);
    eprintln!("loco probe: {banner}, {} steps, lr {}, seed {}", args.steps, lr, args.seed);

    let per_rank: Vec<Vec<Vec<Acc>>> = probe::on_ranks(&setup, args.seed, |comm, mut params, s| {
        let rank = comm.rank();
        // This rank's shard of every layer's padded flat parameters.
        let flat = |params: &[Vec<f32>]| -> Vec<Vec<f32>> {
            (0..layers)
                .map(|l| {
                    let b = plan.bucket(l).unwrap();
                    let mut f = vec![0.0f32; b.padded_len];
                    b.expand_into(&params[l], &mut f).unwrap();
                    f[rank * s[l]..(rank + 1) * s[l]].to_vec()
                })
                .collect()
        };
        // The 1-D positions inside this rank's shard of each layer.
        let one_d: Vec<Vec<bool>> = (0..layers)
            .map(|l| probe::one_d_mask(plan.bucket(l).unwrap())[rank * s[l]..(rank + 1) * s[l]].to_vec())
            .collect();
        let mut exact_opt: Vec<[AdamW; 2]> =
            s.iter().map(|&n| [AdamW::new(optim, n), AdamW::new(long, n)]).collect();
        let mut shadow: Vec<Vec<[AdamW; 2]>> = VARIANTS
            .iter()
            .map(|_| s.iter().map(|&n| [AdamW::new(optim, n), AdamW::new(long, n)]).collect())
            .collect();
        let mut feedback: Vec<Vec<Option<ErrorFeedback>>> = VARIANTS
            .iter()
            .map(|(_, b, _)| (0..layers).map(|_| b.map(ErrorFeedback::loco)).collect())
            .collect();
        let fresh = |s: &[usize]| -> Acc {
            Acc {
                drift: s.iter().map(|&n| vec![0.0; n]).collect(),
                sum_g: s.iter().map(|&n| vec![0.0; n]).collect(),
                sum_uh: s.iter().map(|&n| vec![0.0; n]).collect(),
                sum_u: s.iter().map(|&n| vec![0.0; n]).collect(),
                ..Acc::default()
            }
        };
        let mut out: Vec<Vec<Acc>> =
            phases.iter().map(|_| VARIANTS.iter().map(|_| fresh(s)).collect()).collect();
        for step in 0..args.steps {
            let ph = phases.iter().position(|&(a, b)| (a..b).contains(&step)).unwrap();
            if step > 0 && step.is_multiple_of(LOCO_RESET) {
                feedback.iter_mut().flatten().flatten().for_each(ErrorFeedback::reset);
            }
            let batch = data.global_batch(step as u64, 0, BATCH, seq, args.seed)?;
            let (loss, grads) = full_forward_backward(model, &params, &shard(&batch, rank, w)?)?;
            let shards = flat(&params);
            for acc in out[ph].iter_mut() {
                acc.loss += f64::from(loss);
                acc.steps += 1.0;
            }
            // 1. Every reduction of every layer: exact, and each variant.
            let mut g_exact: Vec<Vec<f32>> = Vec::with_capacity(layers);
            let mut g_var: Vec<Vec<Vec<f32>>> = vec![Vec::with_capacity(layers); VARIANTS.len()];
            for l in 0..layers {
                let (full, g) = probe::exact_mean(comm, plan, l, &grads[l])?;
                // qgZ carries zeros at the 1-D positions (they go exact).
                let mut masked = full;
                let mask = probe::one_d_mask(plan.bucket(l)?);
                masked.iter_mut().zip(&mask).filter(|(_, m)| **m).for_each(|(x, _)| *x = 0.0);
                for (v, gv) in g_var.iter_mut().enumerate() {
                    let mut gh = vec![0.0f32; s[l]];
                    let mut opts = qgz;
                    if VARIANTS[v].2 {
                        // One stream per (seed, step, layer), as the engine keys them.
                        let key = stream_seed(args.seed ^ 0x5EED, &[step as u64, l as u64]);
                        opts.quant = Options::default().stochastic(key);
                    }
                    match feedback[v][l].as_mut() {
                        Some(fb) => qgz_reduce_scatter_with_feedback(comm, &masked, &mut gh, &opts, fb)?,
                        None => qgz_reduce_scatter(comm, &masked, &mut gh, &opts)?,
                    }
                    for ((x, &e), &is1) in gh.iter_mut().zip(&g).zip(&one_d[l]) {
                        if is1 {
                            *x = e;
                        }
                    }
                    gv.push(gh);
                }
                g_exact.push(g);
            }
            // 2. Clipping factors from each reduction's global norm, as the engine clips.
            let sq = |gs: &[Vec<f32>]| gs.iter().flatten().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>();
            let mut local: Vec<f64> = vec![sq(&g_exact)];
            local.extend(g_var.iter().map(|gv| sq(gv)));
            let mut all = vec![0.0f64; local.len() * w];
            comm.all_gather(&zeropp_comm::Group::world(&topo), &local, &mut all)?;
            let factor = |i: usize| {
                let norm = (0..w).map(|r| all[r * local.len() + i]).sum::<f64>().sqrt() as f32;
                clip_factor(norm, cfg.gradient_clipping)
            };
            // 3. Updates from the shared parameters, and the step the trajectory takes.
            let mut new_params = Vec::with_capacity(layers);
            for l in 0..layers {
                let b = plan.bucket(l)?;
                let g = &g_exact[l];
                let mut u = [shards[l].clone(), shards[l].clone()];
                let mut next = None;
                for (k, opt) in exact_opt[l].iter_mut().enumerate() {
                    opt.step(&mut u[k], g, factor(0))?;
                }
                let u_delta: Vec<Vec<f32>> =
                    u.iter().map(|p| p.iter().zip(&shards[l]).map(|(a, b)| a - b).collect()).collect();
                for (v, acc) in out[ph].iter_mut().enumerate() {
                    let gh = &g_var[v][l];
                    for (k, opt) in shadow[v][l].iter_mut().enumerate() {
                        let mut p = shards[l].clone();
                        opt.step(&mut p, gh, factor(v + 1))?;
                        if k == 0 && follow == Some(v) {
                            next = Some(p.clone());
                        }
                        for (i, ((pn, p0), ue)) in p.iter().zip(&shards[l]).zip(&u_delta[k]).enumerate() {
                            let uh = f64::from(pn - p0);
                            let ue = f64::from(*ue);
                            if k == 0 {
                                acc.sum_uh[l][i] += uh;
                                acc.sum_u[l][i] += ue;
                            }
                            acc.uerr[k] += (uh - ue).powi(2);
                            acc.unorm[k] += ue * ue;
                            acc.uhat[k] += uh * uh;
                            if (uh > 0.0) == (ue > 0.0) && ue != 0.0 {
                                acc.sign_ok[k] += 1.0;
                            }
                        }
                    }
                    acc.coords += s[l] as f64;
                    for (i, (&x, &e)) in gh.iter().zip(g).enumerate() {
                        let (x, e) = (f64::from(x), f64::from(e));
                        acc.gerr += (x - e).powi(2);
                        acc.gnorm += e * e;
                        acc.drift[l][i] += x - e;
                        acc.sum_g[l][i] += e;
                        if e != 0.0 {
                            acc.moved += 1.0;
                            if x == 0.0 {
                                acc.zeroed += 1.0;
                            }
                        }
                    }
                }
                // The trajectory: gather the taken shards.
                let mut gathered = vec![0.0f32; b.padded_len];
                let taken = next.as_deref().unwrap_or(&u[0]);
                world_all_gather(comm, Routing::Hierarchical, DenseWire::F32, taken, &mut gathered)?;
                new_params.push(b.compact(&gathered)?);
            }
            params = new_params;
        }
        if rank == 0 {
            let val = data.val_batches(BATCH, seq, 16)?;
            let mut sum = 0.0f64;
            for b in &val {
                sum += f64::from(zeropp_engine::model::full_forward(model, &params, b)?.0);
            }
            eprintln!("validation loss at the end of the trajectory: {:.4}", sum / val.len() as f64);
        }
        Ok(out)
    });

    // Sum the ranks.
    let mut md = String::new();
    writeln!(
        md,
        "loco probe: {banner}, default GPT, {} steps, lr {}, seed {}, AdamW β2 {}, trajectory: {}\n",
        args.steps,
        lr,
        args.seed,
        optim.beta2,
        follow.map_or("exact (f32 reduce-scatter)", |v| VARIANTS[v].0)
    )
    .unwrap();
    writeln!(
        md,
        "| steps | variant | grad err | grad drift | zeroed | update err | \\|û\\|/\\|u\\| | sign | update err β2 {LONG_BETA2} | cos(Σû, Σu) | \\|Σû\\|/\\|Σu\\| | cos, attention | \\|Σû\\|/\\|Σu\\|, attention |"
    )
    .unwrap();
    writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|---|").unwrap();
    // Which flat positions of each layer's padded buffer hold attention matrices.
    let attn: Vec<Vec<bool>> = (0..layers)
        .map(|l| {
            let b = plan.bucket(l).unwrap();
            let mut mask = vec![false; b.padded_len];
            for p in b.params.iter().filter(|p| p.name.contains("attn") && p.shape.len() == 2) {
                mask[p.range()].iter_mut().for_each(|m| *m = true);
            }
            mask
        })
        .collect();
    for (pi, &(a, b)) in phases.iter().enumerate() {
        for (v, (name, _, _)) in VARIANTS.iter().enumerate() {
            let mut t = Acc::default();
            let (mut dn, mut gn) = (0.0f64, 0.0f64);
            // [all, attention]: Σû·Σu, ‖Σû‖², ‖Σu‖².
            let mut cum = [[0.0f64; 3]; 2];
            for (rank, rank_accs) in per_rank.iter().enumerate() {
                let r = &rank_accs[pi][v];
                t.gerr += r.gerr;
                t.gnorm += r.gnorm;
                for k in 0..2 {
                    t.uerr[k] += r.uerr[k];
                    t.unorm[k] += r.unorm[k];
                    t.uhat[k] += r.uhat[k];
                    t.sign_ok[k] += r.sign_ok[k];
                }
                t.coords += r.coords;
                t.zeroed += r.zeroed;
                t.moved += r.moved;
                dn += r.drift.iter().flatten().map(|x| x * x).sum::<f64>();
                gn += r.sum_g.iter().flatten().map(|x| x * x).sum::<f64>();
                for l in 0..layers {
                    let sl = r.sum_u[l].len();
                    for (i, (uh, u)) in r.sum_uh[l].iter().zip(&r.sum_u[l]).enumerate() {
                        let is_attn = attn[l][rank * sl + i];
                        for (c, on) in cum.iter_mut().zip([true, is_attn]) {
                            if on {
                                c[0] += uh * u;
                                c[1] += uh * uh;
                                c[2] += u * u;
                            }
                        }
                    }
                }
            }
            let ratio = |x: f64, y: f64| (x / y).sqrt();
            if v == 0 {
                let (l, n): (f64, f64) = per_rank
                    .iter()
                    .map(|r| (r[pi][0].loss, r[pi][0].steps))
                    .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
                eprintln!("steps {a}-{b}: mean training loss on the trajectory {:.4}", l / n);
            }
            writeln!(
                md,
                "| {a}-{b} | {name} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
                ratio(t.gerr, t.gnorm),
                ratio(dn, gn),
                t.zeroed / t.moved.max(1.0),
                ratio(t.uerr[0], t.unorm[0]),
                ratio(t.uhat[0], t.unorm[0]),
                t.sign_ok[0] / t.coords,
                ratio(t.uerr[1], t.unorm[1]),
                cum[0][0] / (cum[0][1] * cum[0][2]).sqrt(),
                ratio(cum[0][1], cum[0][2]),
                cum[1][0] / (cum[1][1] * cum[1][2]).sqrt(),
                ratio(cum[1][1], cum[1][2]),
            )
            .unwrap();
        }
    }
    print!("{md}");
    if let Some(p) = args.out {
        std::fs::write(&p, &md).expect("write --out");
    }
}
