//! DeepSpeed's bucket knobs (`zero.buckets`): each has its effect on the byte
//! counters or on the schedule, and the counters still equal the analytic model.

use zeropp_comm::Topology;
use zeropp_engine::config::{BucketKnobs, CommDtype, EngineConfig, ZeroConfig};
use zeropp_engine::engine::{PERSISTENT_BUCKET, build_plan, tags};
use zeropp_engine::model::{Gpt, GptConfig, Model};
use zeropp_engine::{RunConfig, TrainReport};
use zeropp_run::train::{TrainConfig, train};

use super::tiny_gpt_run;

fn run(zero: ZeroConfig) -> TrainReport {
    let cfg =
        tiny_gpt_run(8, 4, EngineConfig { zero, global_batch: 16, grad_accum: 2, ..EngineConfig::default() });
    train(&TrainConfig { run: RunConfig { steps: 3, eval_batches: 1, keep_params: false, ..cfg.run }, ..cfg })
        .unwrap()
}

/// The vocabulary of the tiny runs' data (the model's, in training).
fn markov_vocab() -> usize {
    let cfg = tiny_gpt_run(8, 4, EngineConfig::default());
    zeropp_engine::data::load_data(&cfg.data).unwrap().0.vocab_size()
}

fn knobs(f: impl Fn(&mut BucketKnobs)) -> impl Fn(ZeroConfig) -> ZeroConfig {
    move |mut z| {
        f(&mut z.buckets);
        z
    }
}

/// Every step's counters equal the analytic model, op by op.
fn assert_counters_match(r: &TrainReport, what: &str) {
    let s = &r.summary;
    for rec in &r.steps {
        for (op, b) in &rec.bytes_by_op {
            assert_eq!(Some(b), s.model_bytes_by_op.get(op), "{what}: op {op}");
        }
        assert_eq!(rec.bytes_by_op.len(), s.model_bytes_by_op.len(), "{what}");
    }
}

fn op(r: &TrainReport, tag: &str) -> f64 {
    r.summary.bytes_by_op.get(tag).map_or(0.0, |b| b.total())
}

#[test]
fn persistent_parameters_are_never_gathered_per_layer() {
    // The tiny GPT's 1-D parameters have at most 4·d = 64 elements.
    let threshold = 64;
    let persist = knobs(move |k| k.param_persistence_threshold = threshold);
    let exact = ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() };
    for z in [ZeroConfig::zero3(), ZeroConfig::zeropp(4), exact] {
        let base = run(z);
        let with = run(persist(z));
        assert_counters_match(&with, &format!("{z:?} with persistence"));
        // Fewer bytes per layer gather, one dense gather of the persistent bucket per step.
        assert!(op(&with, tags::FWD_GATHER) < op(&base, tags::FWD_GATHER), "{z:?}");
        assert!(op(&with, tags::BWD_GATHER) < op(&base, tags::BWD_GATHER), "{z:?}");
        assert!(op(&with, tags::PERSIST_GATHER) > 0.0 && op(&base, tags::PERSIST_GATHER) == 0.0);
        // The same training: exactly the same gradients with exact communication
        // (only the f64 norm's summation order differs), close otherwise.
        for (a, b) in base.steps.iter().zip(&with.steps) {
            let tol = if z.comm_dtype == CommDtype::F32 { 1e-5 } else { 2e-2 };
            assert!((a.loss - b.loss).abs() <= tol * a.loss.abs(), "{z:?}: {} vs {}", a.loss, b.loss);
        }
    }
    // The plan: no layer bucket holds a parameter of <= threshold elements; the
    // persistent bucket holds them all.
    let model = Gpt::new(GptConfig::tiny()).unwrap();
    let cfg = EngineConfig { zero: persist(ZeroConfig::zeropp(4)), ..EngineConfig::default() };
    let plan = build_plan(&model, &cfg, Topology::ranks(8).per_node(4).unwrap()).unwrap();
    let small: usize = model
        .layers()
        .iter()
        .flat_map(|l| &l.params)
        .filter(|p| p.numel() <= threshold)
        .map(|p| p.numel())
        .sum();
    assert!(small > 0);
    for b in plan.buckets() {
        let persistent = b.name == PERSISTENT_BUCKET;
        assert!(b.params.iter().all(|p| (p.numel <= threshold) == persistent), "{}", b.name);
    }
    assert_eq!(plan.buckets().last().map(|b| (b.name.as_str(), b.numel)), Some((PERSISTENT_BUCKET, small)));
    // Everything persistent: the layer buckets are empty and only the persistent gather moves weights.
    let all = run(knobs(|k| k.param_persistence_threshold = usize::MAX)(ZeroConfig::zeropp(4)));
    assert_counters_match(&all, "all persistent");
    assert_eq!(op(&all, tags::FWD_GATHER) + op(&all, tags::BWD_GATHER), 0.0);
    assert!(all.summary.final_loss.is_finite());
}

#[test]
fn reduce_bucket_size_splits_the_gradient_reduce() {
    // The tiny GPT's blocks pad to 8 ranks x 512 elements: a reduce bucket of
    // 8 x 256 reduces each in two calls.
    let split = knobs(|k| k.reduce_bucket_size = Some(8 * 256));
    let exact = ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() };
    for z in [ZeroConfig::zero3(), ZeroConfig::zeropp(4), exact] {
        let base = run(z);
        let with = run(split(z));
        assert_counters_match(&with, &format!("{z:?} split"));
        let (a, b) = (op(&base, tags::GRAD_REDUCE), op(&with, tags::GRAD_REDUCE));
        if z.qgz.is_some() {
            // Each qgZ call has its own headers and its own scales for a partial group.
            assert!(b > a, "{z:?}: {b} vs {a}");
        } else {
            // Dense bytes do not depend on how the elements are split into calls.
            assert_eq!(a, b, "{z:?}");
        }
        if z.comm_dtype == CommDtype::F32 {
            // The same sums: the same training.
            for (x, y) in base.steps.iter().zip(&with.steps) {
                assert!((x.loss - y.loss).abs() <= 1e-6 * x.loss.abs());
            }
        }
    }
    // Too small to hold one quantization group per rank: a clear error.
    let cfg = tiny_gpt_run(
        8,
        4,
        EngineConfig {
            zero: knobs(|k| k.reduce_bucket_size = Some(100))(ZeroConfig::zeropp(4)),
            ..EngineConfig::default()
        },
    );
    let err = train(&cfg).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("reduce_bucket_size 100"), "{err}");
}

#[test]
fn prefetch_knobs_limit_what_is_prefetched() {
    let model = Gpt::new(GptConfig::tiny().with_vocab(markov_vocab())).unwrap();
    let base = ZeroConfig::zero3();
    let plan = build_plan(&model, &EngineConfig::default(), Topology::ranks(8).per_node(4).unwrap()).unwrap();
    let sizes: Vec<usize> = plan.buckets().iter().map(|b| b.padded_len).collect();
    let n = sizes.len();
    // The schedule, independently: forward prefetches l+1 while l computes,
    // backward l-1 while l computes (2 micro-batches per step, 8 ranks).
    let expected = |ok: &dyn Fn(usize, usize) -> bool| -> usize {
        let fwd = (0..n - 1).filter(|&l| ok(sizes[l], sizes[l + 1])).count();
        let bwd = (1..n).filter(|&l| ok(sizes[l], sizes[l - 1])).count();
        8 * 2 * (fwd + bwd)
    };
    let block = sizes[1];
    let small = sizes.iter().copied().filter(|&s| s < block).max().unwrap();
    type Rule = Box<dyn Fn(usize, usize) -> bool>;
    let cases: Vec<(BucketKnobs, Rule)> = vec![
        (BucketKnobs::default(), Box::new(|_, _| true)),
        (BucketKnobs { prefetch_bucket_size: Some(0), ..Default::default() }, Box::new(|_, _| false)),
        (
            BucketKnobs { prefetch_bucket_size: Some(small), ..Default::default() },
            Box::new(move |_, n| n <= small),
        ),
        (
            BucketKnobs { max_live_parameters: Some(block + small), ..Default::default() },
            Box::new(move |c, n| c + n <= block + small),
        ),
    ];
    let plain = run(base);
    for (k, ok) in cases {
        let r = run(ZeroConfig { buckets: k, ..base });
        assert_counters_match(&r, &format!("{k:?}"));
        for rec in &r.steps {
            assert_eq!(rec.prefetched_gathers, expected(&*ok), "{k:?}");
        }
        // The schedule changes, the bytes and the numbers do not.
        assert_eq!(r.summary.bytes_by_op, plain.summary.bytes_by_op, "{k:?}");
        for (a, b) in plain.steps.iter().zip(&r.steps) {
            assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{k:?}");
        }
    }
}
