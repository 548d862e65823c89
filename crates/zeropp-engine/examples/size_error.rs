//! The engine's qwZ and qgZ against the exact collectives, for a GPT of any
//! shape (`cargo xtask bench fidelity-size` runs it at every width up to
//! GPT-2 small's and draws the engine's curve beside the HF Llama's).
//!
//! Four ranks (2 nodes × 2, thread backend, as the HF Llama's curve runs;
//! eight ranks' copies of GPT-2 small would not fit a small machine) train
//! the GPT along the exact trajectory (f32 reduce-scatters and gathers,
//! clipping, AdamW), as `qgz_error` does. At the probed steps each rank also runs both quantized
//! collectives of `zeropp train`'s default (`ZeroConfig::zeropp`) on the same
//! inputs:
//!
//! - qgZ: its local gradients, padded to the engine's buckets with the 1-D
//!   parameters zeroed (they travel exactly), through `qgz_reduce_scatter`
//!   (INT4, groups of 256 per tensor, stochastic rounding) against the exact
//!   mean;
//! - qwZ: its shard of the current weights through `world_qwz_all_gather`
//!   (INT8, groups of 256, hierarchical) against the weights themselves.
//!
//! Reported per layer kind (`wte`, `attn.qkv`, `mlp.fc`, `lm_head`, ...; the
//! 1-D parameters left out), summed over every rank's shard: the cosine
//! similarity, the relative norm error `‖q − e‖ / ‖e‖` and, for gradients, the
//! relative error of AdamW's update direction `m̂ / (√v̂ + ε)` taken with the
//! quantized gradient and with the exact one, from moments kept over the
//! exact gradients (the engine's betas). The JSON (`--out`) has the schema of
//! `python/bench/fidelity_size.py`'s, so one report reads both.
//!
//! ```text
//! cargo run --release -p zeropp-engine --example size_error -- --model gpt-10m \
//!     [--seq 64] [--steps 12] [--probe 1,10,last] [--data generated|shakespeare|FILE] [--seed 1] [--out FILE.json]
//! ```
//!
//! `--model` takes the names of `GptConfig::presets` (`gpt`, `gpt-1m`, ...,
//! `gpt2-small`); `--seq` replaces the preset's context (64 by default: the
//! errors are per element, and a short context keeps GPT-2 small's steps
//! affordable on a CPU).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench driver: failures abort

use std::collections::BTreeMap;

use zeropp_comm::collectives::qgz_reduce_scatter;
use zeropp_comm::collectives::{QgzOptions, QwzOptions, Routing, world_qwz_all_gather};
use zeropp_engine::config::{AdamWConfig, ZeroConfig};
use zeropp_engine::data::shard;
use zeropp_engine::model::{GptConfig, full_forward_backward};
use zeropp_engine::optim::AdamW;
use zeropp_quant::Options;
use zeropp_quant::rng::stream_seed;

#[allow(dead_code)] // the probes' helpers this one does not call
mod probe;
use probe::{BATCH, Setup};

/// Ranks per node.
const LOCAL: usize = 2;

/// Sums of one (collective, kind): `g·e, g·g, e·e, (g−e)²` and, for
/// gradients, the update directions' `(u_q − u_e)², u_e²`.
type Sums = [f64; 6];

/// The kind of a parameter by its name in the bucket
/// (`block3.attn.qkv.weight` → `attn.qkv`, `embed.wte` → `wte`).
fn kind(name: &str) -> String {
    let name = name.split_once('.').map_or(name, |(_, rest)| rest);
    name.strip_suffix(".weight").unwrap_or(name).to_string()
}

fn add(s: &mut Sums, g: f64, e: f64) {
    s[0] += g * e;
    s[1] += g * g;
    s[2] += e * e;
    s[3] += (g - e) * (g - e);
}

fn main() {
    let (mut model, mut seq, mut probes) = ("gpt-1m".to_string(), 64usize, "1,10,last".to_string());
    let args = probe::parse_args(12, |flag, v| {
        match flag {
            "--model" => model = v,
            "--seq" => seq = v.parse().expect("--seq N"),
            "--probe" => probes = v,
            _ => return false,
        }
        true
    });
    let preset = GptConfig::preset(&model).unwrap_or_else(|| {
        let names: Vec<&str> = GptConfig::presets().iter().map(|p| p.0).collect();
        panic!("--model {model}: not a preset; known: {names:?}")
    });
    let probe_steps: Vec<usize> = probes
        .split(',')
        .map(|p| if p == "last" { args.steps } else { p.parse().expect("--probe N,N,last") })
        .collect();
    assert!(
        probe_steps.iter().all(|&p| (1..=args.steps).contains(&p)),
        "--probe {probes}: steps run from 1 to --steps {}",
        args.steps
    );
    let setup =
        probe::setup_gpt(&args.data, ZeroConfig::zeropp(LOCAL), GptConfig { seq_len: seq, ..preset }, LOCAL);
    let Setup { data, model: gpt, plan, cfg, banner, .. } = &setup;
    let (w, layers) = (setup.world, setup.layers);
    let optim = AdamWConfig::default();
    let spec = ZeroConfig::default_qgz_spec();
    let qwz = QwzOptions { spec: ZeroConfig::default_qwz_spec(), quant: Options::default() };
    eprintln!(
        "size error: {banner}, context {seq}, {} steps, probed at {probe_steps:?}, seed {}",
        args.steps, args.seed
    );
    // Per rank: probed step -> (collective/kind -> sums).
    let per_rank: Vec<BTreeMap<usize, BTreeMap<String, Sums>>> =
        probe::on_ranks(&setup, args.seed, |comm, mut params, s| {
            let rank = comm.rank();
            let mut opt: Vec<AdamW> = s.iter().map(|&n| AdamW::new(optim, n)).collect();
            // Each position of this rank's shard of every layer: its kind (None: 1-D or padding).
            let kinds: Vec<Vec<Option<String>>> = (0..layers)
                .map(|l| {
                    let b = plan.bucket(l)?;
                    let mut k = vec![None; b.padded_len];
                    for p in b.params.iter().filter(|p| p.shape.len() > 1) {
                        k[p.range()].iter_mut().for_each(|x| *x = Some(kind(&p.name)));
                    }
                    Ok(k[rank * s[l]..(rank + 1) * s[l]].to_vec())
                })
                .collect::<Result<_, zeropp_engine::EngineError>>()?;
            let mut moments: Vec<(Vec<f64>, Vec<f64>)> =
                s.iter().map(|&n| (vec![0.0; n], vec![0.0; n])).collect();
            let (b1, b2, eps) = (f64::from(optim.beta1), f64::from(optim.beta2), f64::from(optim.eps));
            let mut out = BTreeMap::new();
            for step in 1..=args.steps {
                let record = probe_steps.contains(&step);
                let mut sums: BTreeMap<String, Sums> = BTreeMap::new();
                if record {
                    // qwZ: this rank's shard of the current weights, gathered.
                    for l in 0..layers {
                        let b = plan.bucket(l)?;
                        let mut flat = vec![0.0f32; b.padded_len];
                        b.expand_into(&params[l], &mut flat)?;
                        let mut got = vec![0.0f32; b.padded_len];
                        world_qwz_all_gather(
                            comm,
                            Routing::Hierarchical,
                            &flat[rank * s[l]..(rank + 1) * s[l]],
                            &mut got,
                            &qwz,
                        )?;
                        // Every rank gathers every shard: each scores its own.
                        let r = rank * s[l]..(rank + 1) * s[l];
                        for ((g, e), k) in got[r.clone()].iter().zip(&flat[r]).zip(&kinds[l]) {
                            if let Some(k) = k {
                                add(
                                    sums.entry(format!("weight/{k}")).or_default(),
                                    f64::from(*g),
                                    f64::from(*e),
                                );
                            }
                        }
                    }
                }
                let batch = data.global_batch(step as u64 - 1, 0, BATCH, seq, args.seed)?;
                let (_, grads) = full_forward_backward(gpt, &params, &shard(&batch, rank, w)?)?;
                let mut exact_all = Vec::with_capacity(layers);
                for l in 0..layers {
                    let (mut full, exact) = probe::exact_mean(comm, plan, l, &grads[l])?;
                    if record {
                        // The engine's qgZ input: the 1-D parameters zeroed (they go exact).
                        let one_d = probe::one_d_mask(plan.bucket(l)?);
                        full.iter_mut().zip(&one_d).filter(|(_, m)| **m).for_each(|(x, _)| *x = 0.0);
                        let keys = [step as u64, l as u64];
                        let mut o = QgzOptions::default().with_spec(spec);
                        o.quant = Options::default().stochastic(stream_seed(args.seed, &keys));
                        let mut got = vec![0.0f32; s[l]];
                        qgz_reduce_scatter(comm, &full, &mut got, &o)?;
                        let (m, v) = &moments[l];
                        let t = step as i32;
                        let dir = |i: usize, g: f64| {
                            let (mm, vv) = (b1 * m[i] + (1.0 - b1) * g, b2 * v[i] + (1.0 - b2) * g * g);
                            (mm / (1.0 - b1.powi(t))) / ((vv / (1.0 - b2.powi(t))).sqrt() + eps)
                        };
                        for (i, k) in kinds[l].iter().enumerate() {
                            if let Some(k) = k {
                                let (g, e) = (f64::from(got[i]), f64::from(exact[i]));
                                let acc = sums.entry(format!("grad/{k}")).or_default();
                                add(acc, g, e);
                                let (uq, ue) = (dir(i, g), dir(i, e));
                                acc[4] += (uq - ue) * (uq - ue);
                                acc[5] += ue * ue;
                            }
                        }
                    }
                    let (m, v) = &mut moments[l];
                    for ((m, v), &e) in m.iter_mut().zip(v.iter_mut()).zip(&exact) {
                        *m = b1 * *m + (1.0 - b1) * f64::from(e);
                        *v = b2 * *v + (1.0 - b2) * f64::from(e) * f64::from(e);
                    }
                    exact_all.push(exact);
                }
                if record {
                    out.insert(step, sums);
                }
                probe::exact_step(comm, plan, cfg.gradient_clipping, &mut opt, &mut params, &exact_all)?;
            }
            Ok(out)
        });
    // Sums over ranks, then the figures per probed step and kind.
    let mut probes_json = serde_json::Map::new();
    let (mut worst_g, mut worst_w) = (0.0f64, 0.0f64);
    for &step in &probe_steps {
        let mut total: BTreeMap<String, Sums> = BTreeMap::new();
        for r in &per_rank {
            for (k, v) in r.get(&step).into_iter().flatten() {
                let t = total.entry(k.clone()).or_default();
                t.iter_mut().zip(v).for_each(|(a, b)| *a += b);
            }
        }
        let mut at = serde_json::Map::new();
        for (k, s) in total {
            let rel = (s[3] / s[2].max(f64::MIN_POSITIVE)).sqrt();
            let mut fig = serde_json::json!({
                "cosine": s[0] / (s[1] * s[2]).sqrt().max(f64::MIN_POSITIVE),
                "rel_norm_error": rel,
            });
            if k.starts_with("grad/") {
                fig["update_rel_error"] = (s[4] / s[5].max(f64::MIN_POSITIVE)).sqrt().into();
                worst_g = worst_g.max(rel);
            } else {
                worst_w = worst_w.max(rel);
            }
            eprintln!(
                "step {step:>4} {k:<16} rel {rel:.5} cos {:.5}",
                fig["cosine"].as_f64().unwrap_or(f64::NAN)
            );
            at.insert(k, fig);
        }
        probes_json.insert(step.to_string(), at.into());
    }
    let report = serde_json::json!({
        "model": model,
        "params": gpt.num_params(),
        "hidden": gpt.config().d_model,
        "layers": gpt.config().n_layer,
        "seq": seq,
        "steps": args.steps,
        "banner": banner,
        "probes": probes_json,
        "worst": {"grad": worst_g, "weight": worst_w},
    });
    let text = serde_json::to_string_pretty(&report).expect("the report as JSON");
    match &args.out {
        Some(out) => {
            std::fs::write(out, &text).expect("write the report");
            eprintln!("size error: report written to {}", out.display());
        }
        None => println!("{text}"),
    }
}
