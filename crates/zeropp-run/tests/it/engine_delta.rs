//! qwZ-Δ and qgZ's SDP4Bit options inside the engine: the bytes of every step
//! equal the analytic model of its kind (full or difference), by a schedule
//! written here independently of the engine's; every hpZ copy holds exactly
//! what the owners hold; a resumed run repeats the uninterrupted one bit for
//! bit; and a difference step sends no weight byte across nodes but its INT4
//! differences.

use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};
use zeropp_engine::config::{CommDtype, DeltaConfig, QgzConfig, ZeroConfig};
use zeropp_engine::data::shard;
use zeropp_engine::engine::ZeroEngine;
use zeropp_engine::engine::build_plan;
use zeropp_engine::engine::bytes::{StepKind, step_bytes_of};
use zeropp_engine::model::{GptConfig, MlpConfig};
use zeropp_run::train::{ModelChoice, train};

use super::accum_run as run;

/// qwZ-Δ with a refresh every `k` steps on `ZeroConfig::zeropp_delta`.
fn delta(local: usize, hpz: usize, k: usize) -> ZeroConfig {
    let mut z = ZeroConfig::zeropp_delta(local).with_hpz(hpz);
    z.qwz_delta = Some(DeltaConfig { refresh_every: k, ..DeltaConfig::default() });
    z
}

/// The steps that rebuild the copies, written from the docs of `DeltaConfig`:
/// the first of the run, every `k`-th, and the one after a saved checkpoint.
fn full_steps(steps: usize, k: usize, save_every: Option<usize>) -> Vec<bool> {
    (0..steps)
        .map(|i| i == 0 || (k > 0 && i % k == 0) || save_every.is_some_and(|e| i > 0 && i % e == 0))
        .collect()
}

#[test]
fn every_step_sends_the_bytes_of_its_kind() {
    let tiny = ModelChoice::Gpt(GptConfig::tiny());
    let mlp = ModelChoice::Mlp(MlpConfig::tiny());
    // (world, local, hpz, refresh_every, save_every): hpZ over the node, and two
    // copies per node (H < L: the forwarding hop); one node; saves force refreshes.
    let cases = [
        (8, 4, 4, 3, None),
        (8, 4, 2, 0, None),
        (4, 2, 2, 2, Some(3)),
        (4, 4, 4, 4, None),
        (6, 3, 3, 0, Some(2)),
    ];
    for (i, &(w, l, h, k, save)) in cases.iter().enumerate() {
        for accum in [1, 2] {
            let model = if i % 2 == 0 { tiny.clone() } else { mlp.clone() };
            let mut cfg = run(w, l, delta(l, h, k), accum, 7, model);
            let dir = tempfile::tempdir().unwrap();
            if let Some(e) = save {
                cfg.run.save = Some(dir.path().to_path_buf());
                cfg.run.save_every = e;
            }
            let r = train(&cfg).unwrap();
            let (m, data, _) = cfg.build().unwrap();
            let _ = data;
            let topo = Topology::ranks(w).per_node(l).unwrap();
            let plan = build_plan(&m, &cfg.run.engine, topo).unwrap();
            let full = step_bytes_of(&plan, &cfg.run.engine, accum, StepKind::Full).unwrap();
            let diff = step_bytes_of(&plan, &cfg.run.engine, accum, StepKind::Delta).unwrap();
            let kinds = full_steps(cfg.run.steps, k, save);
            for (rec, &is_full) in r.steps.iter().zip(&kinds) {
                let want = if is_full { &full } else { &diff };
                let ctx =
                    format!("case {i} W={w} L={l} H={h} K={k} A={accum} step {} full {is_full}", rec.step);
                assert_eq!(rec.bytes_by_op, want.by_op, "{ctx}");
                if !is_full {
                    // Across nodes: the differences and qgZ's rail hop, no weight gather.
                    assert_eq!(rec.bytes_by_op.get("fwd_gather").map_or(0.0, |b| b.inter), 0.0, "{ctx}");
                    assert!(
                        w == l || rec.bytes_by_op.get("fwd_delta").is_some_and(|b| b.inter > 0.0),
                        "{ctx}"
                    );
                }
            }
            let s = &r.summary;
            assert_eq!(s.bytes_by_op, s.model_bytes_by_op, "case {i} A={accum}: the run's mean");
        }
    }
}

/// Drives the engine by hand on a thread cluster: `steps` steps of the preset
/// on `world × local`, returning each rank's copy drift after every step.
fn drift_after_steps(world: usize, local: usize, zero: ZeroConfig, steps: usize) -> Vec<Vec<f64>> {
    let cfg = run(world, local, zero, 1, steps, ModelChoice::Gpt(GptConfig::tiny()));
    let (model, data, _) = cfg.build().unwrap();
    let topo = Topology::ranks(world).per_node(local).unwrap();
    let ecfg = cfg.run.engine.clone();
    let seq = GptConfig::tiny().seq_len;
    ThreadCluster::new(topo, ThreadOptions::default())
        .run(|comm| {
            let rank = comm.rank();
            let mut e = ZeroEngine::new(&model, &ecfg, topo, rank)?;
            let micro = ecfg.micro_batch(world)?;
            let mut out = Vec::new();
            for step in 0..steps {
                let global = data.global_batch(step as u64, 0, micro * world, seq, ecfg.seed)?;
                e.train_step(comm, None, &[shard(&global, rank, world)?])?;
                out.push(e.delta_copy_drift(comm)?);
            }
            Ok::<_, zeropp_engine::EngineError>(out)
        })
        .unwrap()
}

/// After every step, every rank's hpZ copy holds exactly (bit for bit) what
/// the owners' `Ŵ` hold, in bf16 and in f32 copies, with one and two copies
/// per node: sender and receivers apply the same difference the same way.
#[test]
fn every_copy_holds_exactly_what_the_owners_hold() {
    for (w, l, h) in [(8, 4, 4), (8, 4, 2), (4, 2, 2)] {
        for dtype in [CommDtype::Bf16, CommDtype::F32] {
            let z = ZeroConfig { comm_dtype: dtype, ..delta(l, h, 0) };
            for (rank, d) in drift_after_steps(w, l, z, 4).into_iter().enumerate() {
                assert!(d.iter().all(|&x| x == 0.0), "W={w} L={l} H={h} {dtype:?} rank {rank}: drift {d:?}");
            }
        }
    }
}

/// A checkpoint makes the next step a full one, in the run that saved it as in
/// the run that resumes from it: the two repeat each other bit for bit.
#[test]
fn resume_reproduces_the_uninterrupted_run() {
    for k in [0, 4] {
        let z = delta(4, 4, k);
        let dir = tempfile::tempdir().unwrap();
        let mut full = run(8, 4, z, 2, 9, ModelChoice::Gpt(GptConfig::tiny()));
        full.run.save = Some(dir.path().join("full"));
        full.run.save_every = 5;
        let a = train(&full).unwrap();
        let mut first = full.clone().with_steps(5);
        first.run.save = Some(dir.path().join("part"));
        train(&first).unwrap();
        let mut second = full.clone();
        second.run.save = None;
        second.run.resume = Some(dir.path().join("part"));
        let b = train(&second).unwrap();
        let bits = |r: &zeropp_engine::TrainReport, from: usize| {
            r.steps.iter().filter(|s| s.step >= from).map(|s| s.loss.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(bits(&a, 5), bits(&b, 5), "K={k}: losses after the resume");
        assert_eq!(a.params, b.params, "K={k}: final parameters");
    }
}

/// The preset and each of its switches alone train on the tiny GPT: over the
/// run, the training loss falls at least half as far as ZeRO-3's does on the
/// same seed and ends within 10% of ZeRO-3's (a smoke check; the fidelity of
/// the defaults is judged over seeds and corpora elsewhere). Both ends are
/// means over 30 steps (one step's loss on one batch is noisier than a short
/// run's fall). Seed 2: on seed 1 this run stays on the loss plateau for
/// ZeRO-3 itself (a 2% fall in 300 steps), where which run leaves it first is
/// chance (Hadamard's qgZ fell 0.6% there and led on seed 2 at 800 steps).
#[test]
fn the_preset_and_its_switches_train() {
    let mut base = run(8, 4, ZeroConfig::zero3(), 2, 300, ModelChoice::Gpt(GptConfig::tiny()));
    base.run.engine.optim.lr = 1e-2;
    let ends = |r: &zeropp_engine::TrainReport| {
        let mean = |s: &[zeropp_engine::metrics::StepRecord]| {
            s.iter().map(|s| f64::from(s.loss)).sum::<f64>() / s.len() as f64
        };
        (mean(&r.steps[..30]), mean(&r.steps[r.steps.len() - 30..]))
    };
    let (z3_first, z3) = ends(&train(&base).unwrap());
    assert!(z3 < z3_first, "ZeRO-3 did not train: {z3_first} -> {z3}");
    let zpp = ZeroConfig::zeropp(4);
    let q = |f: fn(&mut QgzConfig)| {
        let mut c = QgzConfig::with_options(ZeroConfig::default_qgz_spec());
        f(&mut c);
        ZeroConfig { qgz: Some(c), ..zpp }
    };
    for (name, z) in [
        ("zeropp-delta", ZeroConfig::zeropp_delta(4)),
        ("qwz-delta", ZeroConfig { qwz_delta: Some(DeltaConfig::default()), ..zpp }),
        ("two-level", q(|c| c.two_level = true)),
        ("hadamard", q(|c| c.hadamard = true)),
    ] {
        let mut cfg = base.clone();
        cfg.run.engine.zero = z;
        let (first, last) = ends(&train(&cfg).unwrap());
        eprintln!("{name}: loss {first:.4} -> {last:.4} (ZeRO-3 {z3_first:.4} -> {z3:.4})");
        assert!(
            first - last > 0.5 * (z3_first - z3),
            "{name}: loss {first} -> {last}, under half of ZeRO-3's fall {z3_first} -> {z3}"
        );
        assert!((last / z3 - 1.0).abs() < 0.10, "{name}: final loss {last} vs ZeRO-3's {z3}");
    }
}

/// The configurations that cannot work are refused with the fix in the message.
#[test]
fn impossible_combinations_are_refused() {
    let check = |z: ZeroConfig, want: &str| {
        let e = z.validate(8, 4).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    };
    check(ZeroConfig { hpz_size: 1, ..ZeroConfig::zeropp_delta(4) }, "it needs hpZ");
    check(
        ZeroConfig { hpz_wire: zeropp_engine::config::HpzWire::Int8, ..ZeroConfig::zeropp_delta(4) },
        "--hpz-wire dense",
    );
    let mut loco = ZeroConfig::zeropp_delta(4);
    if let Some(q) = loco.qgz.as_mut() {
        q.error_feedback = Some(Default::default());
    }
    check(loco, "do not go together");
    let mut odd = ZeroConfig::zeropp_delta(4);
    if let Some(q) = odd.qgz.as_mut() {
        q.spec = zeropp_engine::config::quant_spec("qgZ", 4, 96).unwrap();
    }
    check(odd, "must be a power of two");
    // Above the rotation's largest group: refused here, not at step 0.
    let big = |g: usize| {
        let mut z = ZeroConfig::zeropp_delta(4);
        if let Some(q) = z.qgz.as_mut() {
            q.spec = zeropp_engine::config::quant_spec("qgZ", 4, g).unwrap();
        }
        z
    };
    check(big(16_384), "power of two of at most 8192, got 16384");
    big(8192).validate(8, 4).unwrap();
}
