//! Model tests: gradients against central finite differences, the checker's
//! own sensitivity, determinism across runs and rayon thread counts, call
//! protocol errors, GEMM and attention kernels.

use zeropp_engine::EngineError;
use zeropp_engine::model::gemm::{MatView, Trans, matmul, sgemm_strided};
use zeropp_engine::model::ops::{self, AttnShape, WeightLayout};
use zeropp_engine::model::{
    Batch, Gpt, GptConfig, Mlp, MlpConfig, Model, full_forward, full_forward_backward, init_params,
};

/// Tiny deterministic generator for test data.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn sym(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

fn random_batch(vocab: usize, batch: usize, seq_len: usize, seed: u64) -> Batch {
    let mut rng = Rng(seed);
    let n = batch * seq_len;
    Batch {
        inputs: (0..n).map(|_| rng.below(vocab) as u32).collect(),
        targets: (0..n).map(|_| rng.below(vocab) as u32).collect(),
        batch,
        seq_len,
    }
}

/// Init, then perturb every parameter (gains, biases included) so that no
/// path of the backward pass is trivially zero.
fn perturbed_params<M: Model>(model: &M, seed: u64, scale: f32) -> Vec<Vec<f32>> {
    let mut params = init_params(model, seed).unwrap();
    let mut rng = Rng(seed ^ 0xABCD);
    for layer in &mut params {
        for v in layer.iter_mut() {
            *v += scale * rng.sym();
        }
    }
    params
}

fn loss_of<M: Model>(model: &M, params: &[Vec<f32>], batch: &Batch) -> f64 {
    f64::from(full_forward(model, params, batch).unwrap().0)
}

/// Central-difference gradient check. For every parameter tensor of every
/// layer: up to `per_tensor` coordinates (all of them for small tensors) are
/// compared one by one, plus one random direction over the whole tensor
/// (directional derivative vs `grad . dir`). Returns the failures.
fn grad_check<M: Model>(
    model: &M,
    params: &[Vec<f32>],
    batch: &Batch,
    grads: &[Vec<f32>],
    per_tensor: usize,
) -> Vec<String> {
    const EPS: f32 = 1e-2;
    const RTOL: f64 = 1e-2;
    const ATOL: f64 = 5e-5;
    let mut failures = Vec::new();
    let mut worst = 0.0_f64;
    let mut rng = Rng(0x5EED);
    for (li, spec) in model.layers().iter().enumerate() {
        let offsets = spec.offsets();
        for (pi, ps) in spec.params.iter().enumerate() {
            let (off, numel) = (offsets[pi], ps.numel());
            let idx: Vec<usize> = if numel <= per_tensor {
                (0..numel).collect()
            } else {
                (0..per_tensor).map(|_| rng.below(numel)).collect()
            };
            let mut p = params.to_vec();
            for &i in &idx {
                let j = off + i;
                let orig = params[li][j];
                p[li][j] = orig + EPS;
                let lp = loss_of(model, &p, batch);
                p[li][j] = orig - EPS;
                let lm = loss_of(model, &p, batch);
                p[li][j] = orig;
                let fd = (lp - lm) / (2.0 * f64::from(EPS));
                let an = f64::from(grads[li][j]);
                worst = worst.max((an - fd).abs() / (ATOL + RTOL * an.abs().max(fd.abs())));
                if (an - fd).abs() > ATOL + RTOL * an.abs().max(fd.abs()) {
                    failures.push(format!(
                        "{}.{}[{i}]: analytic {an:.6e} vs numeric {fd:.6e}",
                        spec.name, ps.name
                    ));
                }
            }
            // Directional derivative over the whole tensor (unit direction).
            let dir: Vec<f32> = (0..numel).map(|_| rng.sym()).collect();
            let norm = dir.iter().map(|&d| f64::from(d) * f64::from(d)).sum::<f64>().sqrt();
            let dir: Vec<f32> = dir.iter().map(|&d| (f64::from(d) / norm) as f32).collect();
            let an: f64 = dir
                .iter()
                .zip(&grads[li][off..off + numel])
                .map(|(&d, &g)| f64::from(d) * f64::from(g))
                .sum();
            let shifted = |sign: f32| {
                let mut p = params.to_vec();
                for (v, &d) in p[li][off..off + numel].iter_mut().zip(&dir) {
                    *v += sign * EPS * d;
                }
                loss_of(model, &p, batch)
            };
            let fd = (shifted(1.0) - shifted(-1.0)) / (2.0 * f64::from(EPS));
            worst = worst.max((an - fd).abs() / (ATOL + RTOL * an.abs().max(fd.abs())));
            if (an - fd).abs() > ATOL + RTOL * an.abs().max(fd.abs()) {
                failures.push(format!(
                    "{}.{} (direction): analytic {an:.6e} vs numeric {fd:.6e}",
                    spec.name, ps.name
                ));
            }
        }
    }
    eprintln!("grad_check: worst |analytic - numeric| / tolerance = {worst:.3}");
    failures
}

/// `model` with parameters perturbed by `(seed, scale)` (see [`perturbed_params`])
/// and a random batch of `rows` sequences of `seq_len` tokens (the model's own
/// when `None`) drawn from `batch_seed`.
fn case<M: Model>(
    model: M,
    (seed, scale): (u64, f32),
    (rows, seq_len, batch_seed): (usize, Option<usize>, u64),
) -> (M, Vec<Vec<f32>>, Batch) {
    let params = perturbed_params(&model, seed, scale);
    let batch = random_batch(model.vocab_size(), rows, seq_len.unwrap_or(model.seq_len()), batch_seed);
    (model, params, batch)
}

fn gpt_case() -> (Gpt, Vec<Vec<f32>>, Batch) {
    case(Gpt::new(GptConfig::tiny()).unwrap(), (3, 0.3), (2, None, 11))
}

fn mlp_case() -> (Mlp, Vec<Vec<f32>>, Batch) {
    case(Mlp::new(MlpConfig::tiny()).unwrap(), (5, 0.2), (2, None, 13))
}

/// The case's model and gradients, after checking `per_tensor` entries of each
/// tensor against finite differences.
fn checked_gradients<M: Model>(
    (model, params, batch): (M, Vec<Vec<f32>>, Batch),
    per_tensor: usize,
) -> (M, Vec<Vec<f32>>) {
    let (_, grads) = full_forward_backward(&model, &params, &batch).unwrap();
    let failures = grad_check(&model, &params, &batch, &grads, per_tensor);
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    (model, grads)
}

#[test]
fn gpt_gradients_match_finite_differences() {
    checked_gradients(gpt_case(), 48);
}

#[test]
fn gpt_gradients_match_with_shorter_sequences() {
    // seq_len below the model maximum: unused position embeddings get zero gradient.
    let gpt = Gpt::new(GptConfig::tiny()).unwrap();
    let (model, grads) = checked_gradients(case(gpt, (8, 0.3), (3, Some(5), 17)), 16);
    let d = model.config().d_model;
    assert!(grads[0][model.vocab_size() * d + 5 * d..].iter().all(|&g| g == 0.0));
}

#[test]
fn mlp_gradients_match_finite_differences() {
    checked_gradients(mlp_case(), 64);
}

#[test]
fn mlp_without_hidden_layers_gradients_match() {
    let model = Mlp::new(MlpConfig { layers: 0, ..MlpConfig::tiny() }).unwrap();
    checked_gradients(case(model, (9, 0.2), (2, Some(4), 19)), 64);
}

/// The number of failing checks after a tampering with the gradients.
type FailureCount = Box<dyn Fn(&dyn Fn(&mut Vec<Vec<f32>>)) -> usize>;

/// Counts the failing gradient checks (`per_tensor` entries of each tensor) of
/// the case's true gradients after `tamper`ing with them.
fn failures_after<M: Model + 'static>(
    (model, params, batch): (M, Vec<Vec<f32>>, Batch),
    per_tensor: usize,
) -> FailureCount {
    let (_, grads) = full_forward_backward(&model, &params, &batch).unwrap();
    Box::new(move |tamper: &dyn Fn(&mut Vec<Vec<f32>>)| {
        let mut g = grads.clone();
        tamper(&mut g);
        grad_check(&model, &params, &batch, &g, per_tensor).len()
    })
}

#[test]
fn grad_check_catches_wrong_gradients() {
    for (model_name, failures_for) in
        [("gpt", failures_after(gpt_case(), 48)), ("mlp", failures_after(mlp_case(), 64))]
    {
        assert_eq!(failures_for(&|_| {}), 0, "{model_name}: untouched gradients must pass");
        // A 10% error on a whole layer's gradient (e.g. a wrong scale).
        assert!(
            failures_for(&|g| g[1].iter_mut().for_each(|v| *v *= 1.1)) > 0,
            "{model_name}: scaled layer-1 gradient not caught"
        );
        // One wrong coordinate: the largest gradient entry of the head, sign-flipped.
        assert!(
            failures_for(&|g| {
                let last = g.last_mut().unwrap();
                let (i, _) = last.iter().enumerate().max_by(|a, b| a.1.abs().total_cmp(&b.1.abs())).unwrap();
                last[i] = -last[i];
            }) > 0,
            "{model_name}: sign-flipped head coordinate not caught"
        );
        // Dropping the embedding gradient entirely.
        assert!(failures_for(&|g| g[0].fill(0.0)) > 0, "{model_name}: zeroed embedding gradient not caught");
    }
}

fn assert_bitwise_eq(a: &(f32, Vec<Vec<f32>>), b: &(f32, Vec<Vec<f32>>)) {
    assert_eq!(a.0.to_bits(), b.0.to_bits(), "loss differs");
    for (ga, gb) in a.1.iter().zip(&b.1) {
        assert!(ga.iter().zip(gb).all(|(x, y)| x.to_bits() == y.to_bits()), "gradients differ");
    }
}

fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
}

/// The case's loss and gradients are bitwise equal on a second run and in rayon
/// pools of each of `threads` threads.
fn assert_deterministic<M: Model + Sync>(
    (model, params, batch): (M, Vec<Vec<f32>>, Batch),
    threads: &[usize],
) {
    let run = || full_forward_backward(&model, &params, &batch).unwrap();
    let first = run();
    assert_bitwise_eq(&first, &run());
    for &t in threads {
        assert_bitwise_eq(&first, &in_pool(t, run));
    }
}

#[test]
fn gpt_is_bitwise_deterministic_across_runs_and_thread_counts() {
    // Big enough for rayon to split rows and (batch x heads) into several tasks.
    let model =
        Gpt::new(GptConfig { vocab: 30, seq_len: 32, d_model: 32, n_head: 4, n_layer: 2, mlp_ratio: 4 })
            .unwrap();
    assert_deterministic(case(model, (21, 0.1), (8, Some(32), 23)), &[1, 2, 3]);
}

#[test]
fn mlp_is_bitwise_deterministic_across_runs_and_thread_counts() {
    let model = Mlp::new(MlpConfig::default_small().with_vocab(30)).unwrap();
    assert_deterministic(case(model, (25, 0.1), (4, Some(64), 27)), &[1, 2]);
}

/// The mean loss of a batch equals the mean of its halves' losses, and so do
/// the gradients: what data parallelism (mean over ranks) relies on.
#[test]
fn batch_gradient_is_mean_of_shard_gradients() {
    let (model, params, _) = gpt_case();
    let batch = random_batch(model.vocab_size(), 4, model.seq_len(), 29);
    let (loss, grads) = full_forward_backward(&model, &params, &batch).unwrap();
    let half = batch.tokens() / 2;
    let halves: Vec<_> = [0..half, half..2 * half]
        .into_iter()
        .map(|r| Batch {
            inputs: batch.inputs[r.clone()].to_vec(),
            targets: batch.targets[r].to_vec(),
            batch: 2,
            seq_len: batch.seq_len,
        })
        .map(|b| full_forward_backward(&model, &params, &b).unwrap())
        .collect();
    assert!((loss - 0.5 * (halves[0].0 + halves[1].0)).abs() < 1e-5);
    for (li, g) in grads.iter().enumerate() {
        for (j, &v) in g.iter().enumerate() {
            let mean = 0.5 * (halves[0].1[li][j] + halves[1].1[li][j]);
            assert!((v - mean).abs() < 1e-5 + 1e-4 * v.abs(), "layer {li} [{j}]: {v} vs {mean}");
        }
    }
}

#[test]
fn init_is_deterministic_and_loss_starts_near_uniform() {
    let model = Gpt::new(GptConfig::default_small().with_vocab(40)).unwrap();
    let a = init_params(&model, 1).unwrap();
    assert_eq!(a, init_params(&model, 1).unwrap());
    assert_ne!(a, init_params(&model, 2).unwrap());
    // LayerNorm gains start at 1, biases at 0.
    assert!(a[1][..model.config().d_model].iter().all(|&v| v == 1.0));
    let batch = random_batch(40, 2, 64, 3);
    let loss = loss_of(&model, &a, &batch);
    assert!((loss - 40f64.ln()).abs() < 0.1, "init loss {loss}");

    let mlp = Mlp::new(MlpConfig::tiny()).unwrap();
    assert_eq!(init_params(&mlp, 4).unwrap(), init_params(&mlp, 4).unwrap());
}

#[test]
fn layer_specs_have_the_documented_layout() {
    let cfg = GptConfig::tiny();
    let model = Gpt::new(cfg).unwrap();
    let layers = model.layers();
    assert_eq!(layers.len(), cfg.n_layer + 2);
    assert_eq!(layers[0].name, "embed");
    assert_eq!(layers.last().unwrap().name, "head");
    let d = cfg.d_model;
    let f = cfg.mlp_ratio * d;
    let block = d * 4 + d * 3 * d + 3 * d + d * d + d + d * f + f + f * d + d;
    assert_eq!(layers[1].numel(), block);
    assert_eq!(layers[1].offsets()[2], 2 * d);
    // The LM head is [vocab, d]: a token's weights are contiguous.
    let head = &layers.last().unwrap().params[2];
    assert_eq!((head.name.as_str(), head.shape.clone()), ("lm_head.weight", vec![cfg.vocab, d]));
    assert_eq!(model.num_params(), layers.iter().map(|l| l.numel()).sum::<usize>());

    let mlp = Mlp::new(MlpConfig::tiny()).unwrap();
    let c = MlpConfig::tiny();
    assert_eq!(mlp.layers().len(), c.layers + 2);
    assert_eq!(mlp.layers()[1].params[0].shape, vec![c.context * c.hidden, c.hidden]);
}

#[test]
fn a_few_sgd_steps_reduce_the_loss() {
    fn train<M: Model>(model: &M, params: &mut [Vec<f32>], batch: &Batch, lr: f32) -> (f32, f32) {
        let first = full_forward_backward(model, params, batch).unwrap().0;
        for _ in 0..30 {
            let (_, grads) = full_forward_backward(model, params, batch).unwrap();
            for (p, g) in params.iter_mut().zip(&grads) {
                for (v, &gv) in p.iter_mut().zip(g) {
                    *v -= lr * gv;
                }
            }
        }
        (first, full_forward_backward(model, params, batch).unwrap().0)
    }
    let gpt = Gpt::new(GptConfig::tiny()).unwrap();
    let mut p = init_params(&gpt, 1).unwrap();
    let batch = random_batch(gpt.vocab_size(), 4, gpt.seq_len(), 5);
    let (before, after) = train(&gpt, &mut p, &batch, 0.5);
    assert!(after < before - 0.2, "gpt: {before} -> {after}");

    let mlp = Mlp::new(MlpConfig::tiny()).unwrap();
    let mut p = init_params(&mlp, 1).unwrap();
    let batch = random_batch(mlp.vocab_size(), 4, mlp.seq_len(), 6);
    let (before, after) = train(&mlp, &mut p, &batch, 0.3);
    assert!(after < before - 0.2, "mlp: {before} -> {after}");
}

#[test]
fn backward_overwrites_the_gradient_buffer() {
    let (model, params, batch) = gpt_case();
    let (_, reference) = full_forward_backward(&model, &params, &batch).unwrap();
    let mut tape = model.start(&batch).unwrap();
    for (i, p) in params.iter().enumerate() {
        model.forward(i, p, &mut tape).unwrap();
    }
    for i in (0..params.len()).rev() {
        let mut g = vec![f32::NAN; params[i].len()];
        model.backward(i, &params[i], &mut tape, &mut g).unwrap();
        assert_eq!(g, reference[i]);
    }
}

#[test]
fn protocol_and_input_errors() {
    let (model, params, batch) = gpt_case();
    let layers = params.len();
    // Forward out of order.
    let mut tape = model.start(&batch).unwrap();
    assert!(matches!(model.forward(1, &params[1], &mut tape), Err(EngineError::CallOrder(_))));
    assert!(model.loss(&tape).is_nan());
    model.forward(0, &params[0], &mut tape).unwrap();
    // Backward before the forward pass finished.
    let mut g = vec![0.0; params[0].len()];
    assert!(matches!(model.backward(0, &params[0], &mut tape, &mut g), Err(EngineError::CallOrder(_))));
    // Wrong parameter length.
    assert!(matches!(model.forward(1, &params[1][1..], &mut tape), Err(EngineError::LengthMismatch { .. })));
    for (i, p) in params.iter().enumerate().skip(1) {
        model.forward(i, p, &mut tape).unwrap();
    }
    assert!(model.loss(&tape).is_finite());
    // Backward in the wrong order, then a layer out of range.
    assert!(matches!(model.backward(0, &params[0], &mut tape, &mut g), Err(EngineError::CallOrder(_))));
    let mut g = vec![0.0; params[layers - 1].len()];
    assert!(matches!(
        model.backward(layers, &params[layers - 1], &mut tape, &mut g),
        Err(EngineError::LayerOutOfRange { .. })
    ));
    // Wrong gradient length.
    assert!(matches!(
        model.backward(layers - 1, &params[layers - 1], &mut tape, &mut g[1..]),
        Err(EngineError::LengthMismatch { .. })
    ));
    // Bad batches.
    let mut bad = batch.clone();
    bad.inputs[3] = model.vocab_size() as u32;
    assert!(matches!(model.start(&bad), Err(EngineError::TokenOutOfRange { .. })));
    let mut bad = batch.clone();
    bad.targets.pop();
    assert!(matches!(model.start(&bad), Err(EngineError::InvalidBatch(_))));
    let long = random_batch(model.vocab_size(), 1, model.seq_len() + 1, 1);
    assert!(matches!(model.start(&long), Err(EngineError::InvalidBatch(_))));
    assert!(matches!(
        full_forward_backward(&model, &params[1..], &batch),
        Err(EngineError::LengthMismatch { .. })
    ));
    // Bad configs.
    assert!(Gpt::new(GptConfig { n_head: 3, ..GptConfig::tiny() }).is_err());
    assert!(Gpt::new(GptConfig { vocab: 0, ..GptConfig::tiny() }).is_err());
    assert!(Mlp::new(MlpConfig { context: 0, ..MlpConfig::tiny() }).is_err());
    let mut out = vec![0.0; 3];
    assert!(model.init_layer(0, 1, &mut out).is_err());
    assert!(model.init_layer(layers, 1, &mut out).is_err());
}

fn naive(ta: Trans, tb: Trans, m: usize, k: usize, n: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..k {
                let av = if ta == Trans::No { a[i * k + p] } else { a[p * m + i] };
                let bv = if tb == Trans::No { b[p * n + j] } else { b[j * k + p] };
                s += f64::from(av) * f64::from(bv);
            }
            c[i * n + j] = s as f32;
        }
    }
    c
}

/// The `[out, in]` linear (the GPT's LM head) against its slow twin: the
/// `[in, out]` linear on the explicitly transposed weight, forward and every
/// gradient, to the bit's neighbourhood.
#[test]
fn out_in_linear_matches_the_in_out_linear_on_the_transposed_weight() {
    let mut rng = Rng(11);
    for &(rows, din, dout) in &[(1, 1, 1), (7, 5, 3), (12, 16, 65), (3, 33, 8)] {
        let x: Vec<f32> = (0..rows * din).map(|_| rng.sym()).collect();
        let w: Vec<f32> = (0..dout * din).map(|_| rng.sym()).collect(); // [dout, din]
        let b: Vec<f32> = (0..dout).map(|_| rng.sym()).collect();
        let dy: Vec<f32> = (0..rows * dout).map(|_| rng.sym()).collect();
        let wt: Vec<f32> = (0..din * dout).map(|i| w[(i % dout) * din + i / dout]).collect(); // [din, dout]
        let close = |what: &str, a: &[f32], e: &[f32]| {
            assert_eq!(a.len(), e.len(), "{what}");
            for (i, (x, y)) in a.iter().zip(e).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                    "{rows}x{din}->{dout} {what}[{i}]: {x} vs {y}"
                );
            }
        };
        let (mut y, mut y_ref) = (vec![0.0; rows * dout], vec![0.0; rows * dout]);
        ops::linear_with(WeightLayout::OutIn, &x, &w, &b, [rows, din, dout], &mut y).unwrap();
        ops::linear_forward(&x, &wt, &b, rows, din, dout, &mut y_ref).unwrap();
        close("y", &y, &y_ref);
        let (mut dw, mut db, mut dx) =
            (vec![f32::NAN; dout * din], vec![f32::NAN; dout], vec![f32::NAN; rows * din]);
        ops::linear_backward_with(
            WeightLayout::OutIn,
            &x,
            &w,
            &dy,
            [rows, din, dout],
            &mut dw,
            &mut db,
            Some(&mut dx),
        )
        .unwrap();
        let (mut dwt, mut db_ref, mut dx_ref) =
            (vec![0.0; din * dout], vec![0.0; dout], vec![0.0; rows * din]);
        ops::linear_backward(&x, &wt, &dy, rows, din, dout, &mut dwt, &mut db_ref, Some(&mut dx_ref))
            .unwrap();
        let dw_ref: Vec<f32> = (0..dout * din).map(|i| dwt[(i % din) * dout + i / din]).collect(); // back to [dout, din]
        close("dw", &dw, &dw_ref);
        close("db", &db, &db_ref);
        close("dx", &dx, &dx_ref);
    }
}

#[test]
fn gemm_matches_naive_for_all_transposes_and_odd_shapes() {
    let mut rng = Rng(7);
    for &(m, k, n) in &[(1, 1, 1), (3, 5, 7), (17, 9, 33), (64, 16, 3), (5, 0, 4), (0, 3, 2)] {
        let a: Vec<f32> = (0..m * k).map(|_| rng.sym()).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng.sym()).collect();
        for ta in [Trans::No, Trans::Yes] {
            for tb in [Trans::No, Trans::Yes] {
                let mut c = vec![f32::NAN; m * n];
                matmul(ta, tb, m, k, n, &a, &b, 0.0, &mut c).unwrap();
                let want = naive(ta, tb, m, k, n, &a, &b);
                for (x, y) in c.iter().zip(&want) {
                    assert!((x - y).abs() < 1e-5, "{m}x{k}x{n} {ta:?} {tb:?}: {x} vs {y}");
                }
                // beta = 1 accumulates.
                matmul(ta, tb, m, k, n, &a, &b, 1.0, &mut c).unwrap();
                for (x, y) in c.iter().zip(&want) {
                    assert!((x - 2.0 * y).abs() < 1e-5);
                }
            }
        }
    }
}

#[test]
fn gemm_rejects_out_of_bounds_and_overlapping_views() {
    let a = vec![1.0; 6];
    let b = vec![1.0; 6];
    let mut c = vec![0.0; 4];
    assert!(matmul(Trans::No, Trans::No, 2, 3, 2, &a[1..], &b, 0.0, &mut c).is_err());
    assert!(matmul(Trans::No, Trans::No, 2, 3, 2, &a, &b[..5], 0.0, &mut c).is_err());
    assert!(matmul(Trans::No, Trans::No, 2, 3, 2, &a, &b, 0.0, &mut c[..3]).is_err());
    let view = |data| MatView { data, rs: 3, cs: 1 };
    let bview = MatView { data: &b, rs: 2, cs: 1 };
    // C rows overlapping (row stride 1 with 2 columns).
    assert!(sgemm_strided(2, 3, 2, 1.0, view(&a), bview, 0.0, &mut c, 1, 1).is_err());
    assert!(sgemm_strided(2, 3, 2, 1.0, view(&a), bview, 0.0, &mut c, 2, 1).is_ok());
    // Column-major C is fine too.
    assert!(sgemm_strided(2, 3, 2, 1.0, view(&a), bview, 0.0, &mut c, 1, 2).is_ok());
}

#[test]
fn attention_is_causal() {
    let s = AttnShape { batch: 2, seq: 6, heads: 2, head_dim: 4 };
    let d = s.heads * s.head_dim;
    let rows = s.batch * s.seq;
    let mut rng = Rng(31);
    let qkv: Vec<f32> = (0..rows * 3 * d).map(|_| rng.sym()).collect();
    let mut probs = vec![0.0; s.batch * s.heads * s.seq * s.seq];
    let mut out = vec![0.0; rows * d];
    ops::attention_forward(&qkv, s, &mut probs, &mut out).unwrap();
    for t in 0..s.seq {
        // Change keys/values of position t of sequence 0: outputs before t must not move.
        let mut qkv2 = qkv.clone();
        for v in &mut qkv2[t * 3 * d + d..(t + 1) * 3 * d] {
            *v += 1.0;
        }
        let mut out2 = vec![0.0; rows * d];
        ops::attention_forward(&qkv2, s, &mut probs.clone(), &mut out2).unwrap();
        assert_eq!(out[..t * d], out2[..t * d], "position {t} leaked backwards");
        assert_ne!(out[t * d..(t + 1) * d], out2[t * d..(t + 1) * d]);
        // The other sequence is untouched.
        assert_eq!(out[s.seq * d..], out2[s.seq * d..]);
    }
    // Rows of probabilities sum to one and are zero above the diagonal.
    for (i, row) in probs.chunks_exact(s.seq).enumerate() {
        let r = i % s.seq;
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert!(row[r + 1..].iter().all(|&p| p == 0.0));
    }
}

#[test]
fn gelu_gradient_matches_difference_quotient() {
    for i in -40..=40 {
        let u = i as f64 * 0.1;
        let h = 1e-3;
        let fd = (f64::from(ops::gelu((u + h) as f32)) - f64::from(ops::gelu((u - h) as f32))) / (2.0 * h);
        assert!((fd - f64::from(ops::gelu_grad(u as f32))).abs() < 2e-3, "u = {u}");
    }
}

#[test]
fn gelu_matches_the_reference_formula() {
    for i in -200..=200 {
        let u = i as f64 * 0.05;
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let want = 0.5 * u * (1.0 + (c * (u + 0.044715 * u * u * u)).tanh());
        let got = f64::from(ops::gelu(u as f32));
        assert!((got - want).abs() < 1e-6 * (1.0 + want.abs()), "u = {u}: {got} vs {want}");
    }
}
