//! `zeropp plan`'s planner: its bytes are what a real run of the same model
//! measures on its traffic counters, step kind by step kind; its time model
//! behaves as its documented formulas say.

use proptest::prelude::*;
use zeropp_engine::RunConfig;
use zeropp_engine::config::EngineConfig;
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::model::GptConfig;
use zeropp_run::plan::{
    Cluster, Compute, Efficiency, GpuSpec, Overlap, PlanInput, PlanMode, PlanModel, Setting, plan,
};
use zeropp_run::train::{ModelChoice, TrainConfig, train};

const DATA: DataChoice = DataChoice::Markov { seed: 3, chars: 20_000 };

fn cluster(nodes: usize, local: usize, inter: f64) -> Cluster {
    Cluster {
        nodes,
        gpus_per_node: local,
        inter_bytes_per_s: inter,
        intra_bytes_per_s: 300e9,
        latency_s: 20e-6,
    }
}

fn input(model: PlanModel, tokens: usize, c: Cluster, modes: Vec<PlanMode>) -> PlanInput {
    PlanInput {
        model,
        setting: Setting {
            tokens,
            cluster: c,
            gpu: GpuSpec::preset("h100").unwrap(),
            compute: Compute::Shapes,
            efficiency: Efficiency::default(),
            checkpointing: true,
            overlap: Overlap::Prefetch,
        },
        modes,
    }
}

/// Per-step (intra, inter) bytes per GPU that a run of `mode` measures, for
/// each of its first `steps` steps.
fn measured(gpt: GptConfig, nodes: usize, local: usize, mode: PlanMode, steps: usize) -> Vec<(f64, f64)> {
    let w = nodes * local;
    let cfg = TrainConfig {
        model: ModelChoice::Gpt(gpt),
        data: DATA,
        run: RunConfig {
            world: w,
            local_size: local,
            engine: EngineConfig {
                zero: mode.zero(local),
                global_batch: w,
                grad_accum: 1,
                ..EngineConfig::default()
            },
            steps,
            eval_batches: 0,
            ..RunConfig::default()
        },
    };
    let r = train(&cfg).unwrap();
    r.steps.iter().map(|s| (s.intra_node_bytes, s.inter_node_bytes)).collect()
}

/// The planner's bytes per GPU per step equal a run's traffic counters for
/// every mode on two shapes of cluster. For zeropp-delta the plan is the mean
/// over the refresh period: the run's first step is a full one, its second a
/// difference step, and the plan must be `(full + (R-1)·delta) / R`.
#[test]
fn the_planners_bytes_are_what_a_run_counts() {
    let vocab = load_data(&DATA).unwrap().0.vocab_size();
    let gpt =
        GptConfig { seq_len: 16, d_model: 32, n_head: 2, n_layer: 2, ..GptConfig::tiny() }.with_vocab(vocab);
    let model = PlanModel { gpt };
    let r = zeropp_engine::config::DeltaConfig::DEFAULT_REFRESH_EVERY as f64;
    for (nodes, local) in [(2, 2), (2, 4)] {
        let p = plan(&input(model, 16, cluster(nodes, local, 12.5e9), PlanMode::ALL.to_vec())).unwrap();
        for mode in PlanMode::ALL {
            let steps = measured(gpt, nodes, local, mode, 2);
            let (intra, inter) = if mode == PlanMode::ZeroppDelta {
                let (f, d) = (steps[0], steps[1]);
                ((f.0 + (r - 1.0) * d.0) / r, (f.1 + (r - 1.0) * d.1) / r)
            } else {
                assert_eq!(steps[0], steps[1], "{mode:?}: every step of this mode sends the same");
                steps[0]
            };
            let m = &p.modes[mode.name()];
            let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(1.0);
            assert!(
                close(m.intra_node_bytes, intra) && close(m.inter_node_bytes, inter),
                "{mode:?} on {nodes} x {local}: plan ({}, {}) vs run ({intra}, {inter})",
                m.intra_node_bytes,
                m.inter_node_bytes
            );
        }
    }
}

/// The default shape from a parameter count lands within 1% of it from 1B
/// to 1T (6% at 100M, where one step of the width is a larger share), with
/// about GPT-3's aspect ratio (at 100M the embeddings are half the model and
/// take width from the blocks).
#[test]
fn derived_shapes_have_the_parameters_asked() {
    for params in [1e8, 1.3e9, 7e9, 18e9, 70e9, 175e9, 1e12] {
        let m = PlanModel::from_params(params, PlanModel::DEFAULT_VOCAB, 2048).unwrap();
        let got = m.params() as f64;
        let tol = if params < 1e9 { 0.06 } else { 0.01 };
        assert!((got / params - 1.0).abs() < tol, "{params}: {got}");
        let aspect = m.gpt.d_model as f64 / m.gpt.n_layer as f64;
        assert!(
            (if params < 1e9 { 60.0 } else { 90.0 }..=160.0).contains(&aspect),
            "{params}: width {} over {} blocks",
            m.gpt.d_model,
            m.gpt.n_layer
        );
    }
    assert!(PlanModel::from_params(f64::NAN, PlanModel::DEFAULT_VOCAB, 2048).is_err());
    // 2M parameters cannot hold GPT-2's vocabulary twice over: refused, not 6.5M.
    let e = PlanModel::from_params(2e6, PlanModel::DEFAULT_VOCAB, 2048).unwrap_err().to_string();
    assert!(e.contains("nearest GPT"), "{e}");
    // The vocabulary asked for is the one the shape is fitted with.
    let m = PlanModel::from_params(1e8, 32_000, 2048).unwrap();
    assert!((m.params() as f64 / 1e8 - 1.0).abs() < 0.06, "{}", m.params());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// More inter-node bandwidth never makes a step slower, the compute never
    /// depends on it, the step is compute plus what is exposed, and TFLOP/s
    /// are the model's FLOPs over the step.
    #[test]
    fn the_time_model_keeps_its_invariants(
        layers in 1usize..6,
        width in 1usize..4,
        nodes in 1usize..5,
        local in 1usize..5,
        // 1 Gbit/s to 10 Pbit/s: communication-bound to compute-bound.
        decades in 0.0f64..7.0,
        factor in 1.0f64..10.0,
        mode in proptest::sample::select(PlanMode::ALL.to_vec()),
    ) {
        let model = PlanModel::shaped(layers, 128 * width, 1000, 256).unwrap();
        let gbits = 10f64.powf(decades);
        let at = |bw: f64| plan(&input(model, 512, cluster(nodes, local, bw), vec![mode])).unwrap();
        let (slow, fast) = (at(gbits * 1e9 / 8.0), at(factor * gbits * 1e9 / 8.0));
        let (s, f) = (&slow.modes[mode.name()], &fast.modes[mode.name()]);
        prop_assert!(f.step_s <= s.step_s * (1.0 + 1e-12));
        prop_assert!((f.compute_s - s.compute_s).abs() <= 1e-12 * s.compute_s);
        for m in [s, f] {
            let exposed: f64 = m.exposed_s.values().sum();
            prop_assert!((m.compute_s + exposed - m.step_s).abs() <= 1e-9 * m.step_s);
            prop_assert!(m.exposed_s.values().all(|e| *e >= 0.0));
            let (fw, rest) = model.flops(2, true);
            prop_assert!(((fw + rest) / m.step_s / 1e12 - m.tflops_per_gpu).abs() <= 1e-9 * m.tflops_per_gpu);
        }
    }
}

/// At a bandwidth so high that no link time is left, every mode runs at the
/// compute bound, the same for all; at a slow link ZeRO++ beats ZeRO-3 by
/// about what it saves in cross-node bytes.
#[test]
fn the_extremes_are_compute_and_bytes() {
    let model = PlanModel::from_params(1e9, PlanModel::DEFAULT_VOCAB, 1024).unwrap();
    let modes = vec![PlanMode::Zero3, PlanMode::Zeropp];
    let fast = plan(&input(model, 2048, cluster(4, 8, 1e18), modes.clone())).unwrap();
    let (a, b) = (&fast.modes["zero3"], &fast.modes["zeropp"]);
    assert!((a.step_s / b.step_s - 1.0).abs() < 0.02, "{} vs {}", a.step_s, b.step_s);
    let slow = plan(&input(model, 2048, cluster(4, 8, 1e8), modes)).unwrap();
    let (a, b) = (&slow.modes["zero3"], &slow.modes["zeropp"]);
    let bytes = a.inter_node_bytes / b.inter_node_bytes;
    let speed = b.speedup;
    assert!(speed > 0.8 * bytes && speed < 1.05 * bytes, "speedup {speed} against a byte ratio {bytes}");
}

#[test]
fn bad_inputs_are_named() {
    let model = PlanModel::from_params(1e9, PlanModel::DEFAULT_VOCAB, 2048).unwrap();
    let e = |i: PlanInput| plan(&i).unwrap_err().to_string();
    assert!(e(input(model, 3000, cluster(2, 8, 1e9), vec![PlanMode::Zero3])).contains("--tokens 3000"));
    assert!(e(input(model, 2048, cluster(0, 8, 1e9), vec![PlanMode::Zero3])).contains("--nodes"));
    assert!(
        e(input(model, 2048, cluster(2, 8, 0.0), vec![PlanMode::Zero3])).contains("inter-node bandwidth")
    );
    assert!(e(input(model, 2048, cluster(2, 8, 1e9), vec![])).contains("no mode"));
    assert!(e(input(model, 0, cluster(2, 8, 1e9), vec![PlanMode::Zero3])).contains("--tokens 0"));
    let mut i = input(model, 2048, cluster(2, 8, 1e9), vec![PlanMode::Zero3]);
    i.setting.efficiency.compute = 50.0;
    assert!(e(i).contains("--compute-efficiency 50"));
    assert!(PlanModel::shaped(1, 10_000_000_000, 1, 1).unwrap_err().to_string().contains("1e15"));
    assert!(PlanMode::parse("zero4").unwrap_err().to_string().contains("zeropp-delta"));
}

/// The quantization kernels cost their elements over the device's kernel rate
/// (`--gpu ...,kernel=K`), which only modes that quantize feel; the FLOPs
/// reported are what the compute time is made of.
#[test]
fn the_kernel_term_is_the_elements_over_the_kernel_rate() {
    let model = PlanModel::from_params(1e9, PlanModel::DEFAULT_VOCAB, 1024).unwrap();
    let at = |kernel: f64| {
        let mut i = input(model, 2048, cluster(4, 8, 12.5e9), vec![PlanMode::Zero3, PlanMode::Zeropp]);
        // Everything adds without overlap, so the kernel term shows whole.
        i.setting.overlap = Overlap::None;
        i.setting.compute = Compute::Flat;
        i.setting.gpu.kernel_elements_per_s = kernel;
        plan(&i).unwrap()
    };
    let (fast, slow) = (at(1e11), at(5e10));
    let (z3, zpp) = (&fast.modes["zero3"], &fast.modes["zeropp"]);
    assert_eq!(z3.quantized_elements, 0.0);
    assert_eq!(z3.step_s, slow.modes["zero3"].step_s);
    // qwZ dequantizes each gathered layer once, qgZ passes each gradient twice:
    // about three passes over the model.
    let passes = zpp.quantized_elements / model.params() as f64;
    assert!((2.5..3.5).contains(&passes), "{passes} passes over the parameters");
    let extra = slow.modes["zeropp"].step_s - zpp.step_s;
    let expected = zpp.quantized_elements / 5e10 - zpp.quantized_elements / 1e11;
    assert!(
        (extra / expected - 1.0).abs() < 1e-9,
        "{extra} s more at half the kernel rate, expected {expected}"
    );
    let rate = GpuSpec::preset("h100").unwrap().peak_flops * Efficiency::default().compute;
    assert!((fast.flops_per_gpu / rate / zpp.compute_s - 1.0).abs() < 1e-12);
}

/// A measured exposed fraction scales what no overlap exposes: 1 is `none`
/// to the bit, 0 leaves the compute and the exchanges that never hide (the
/// norm's), and the step is linear between; out of 0..=1 it is refused.
#[test]
fn an_exposed_fraction_scales_the_unhidden_communication() {
    let model = PlanModel::from_params(1e9, PlanModel::DEFAULT_VOCAB, 1024).unwrap();
    let at = |overlap: Overlap| {
        let mut i = input(model, 2048, cluster(4, 8, 12.5e9), vec![PlanMode::Zero3, PlanMode::Zeropp]);
        i.setting.overlap = overlap;
        plan(&i)
    };
    let none = at(Overlap::None).unwrap();
    let [all, nothing, half] = [1.0, 0.0, 0.5].map(|f| at(Overlap::Exposed(f)).unwrap());
    for m in ["zero3", "zeropp"] {
        let step = |p: &zeropp_run::plan::Plan| p.modes[m].step_s;
        assert_eq!(step(&all), step(&none), "{m}");
        assert!(step(&nothing) > nothing.modes[m].compute_s && step(&nothing) < step(&none), "{m}");
        let mid = (step(&nothing) + step(&none)) / 2.0;
        assert!((step(&half) / mid - 1.0).abs() < 1e-12, "{m}: {} against {mid}", step(&half));
    }
    assert!(at(Overlap::Exposed(1.5)).unwrap_err().to_string().contains("--overlap 1.5"));
}
