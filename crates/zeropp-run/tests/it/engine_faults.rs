//! Faults and bad inputs end with a clear error (naming the rank) or a counted
//! skipped step: never a hang or a panic.

use std::time::{Duration, Instant};
use zeropp_engine::RunConfig;

use zeropp_engine::EngineError;
use zeropp_engine::config::{EngineConfig, ZeroConfig};
use zeropp_engine::data::DataChoice;
use zeropp_engine::launch::Faults;
use zeropp_engine::model::GptConfig;
use zeropp_run::RunError;
use zeropp_run::train::{ModelChoice, TrainConfig, train};

fn tiny(world: usize, local: usize) -> TrainConfig {
    TrainConfig {
        model: ModelChoice::Gpt(GptConfig::tiny()),
        data: DataChoice::Markov { seed: 2, chars: 10_000 },
        run: RunConfig {
            world,
            local_size: local,
            engine: EngineConfig {
                zero: ZeroConfig::zeropp(local),
                global_batch: 8,
                ..EngineConfig::default()
            },
            steps: 4,
            eval_batches: 1,
            timeout: Duration::from_secs(5),
            ..RunConfig::default()
        },
    }
}

#[test]
fn a_failing_rank_is_named_with_its_cause() {
    for (rank, step) in [(2, 1), (0, 0), (7, 2)] {
        let cfg = {
            let b = tiny(8, 4);
            TrainConfig {
                run: RunConfig { faults: Faults { fail: Some((rank, step)), ..Faults::default() }, ..b.run },
                ..b
            }
        };
        let t0 = Instant::now();
        let err = train(&cfg).unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
        match &err {
            RunError::Engine(EngineError::RankFailed { rank: r, cause }) => {
                assert_eq!(*r, rank, "{err}");
                assert!(cause.to_string().contains("injected failure"), "{err}");
            }
            other => panic!("unexpected error {other}"),
        }
        assert!(err.to_string().contains(&format!("rank {rank}")));
    }
}

/// A NaN in one rank's *local* gradient (before any reduce, where a real overflow
/// appears) is skipped by every rank, in every mode: under qgZ the quantizer never
/// sees it (it rejects non-finite input), and no rank errors out.
#[test]
fn a_nan_gradient_skips_the_step_and_counts_it() {
    let qgz_alone = ZeroConfig::zero3().with_qgz(zeropp_engine::config::QgzConfig::default());
    for (world, local) in [(4, 2), (8, 4), (4, 1)] {
        for zero in [ZeroConfig::zero3(), qgz_alone, ZeroConfig::zeropp(local)] {
            let mut cfg = {
                let b = tiny(world, local);
                TrainConfig {
                    run: RunConfig {
                        faults: Faults { nan_gradient: Some((world - 1, 1)), ..Faults::default() },
                        keep_params: true,
                        ..b.run
                    },
                    ..b
                }
            };
            cfg.run.engine.zero = zero;
            let label = format!("{} on {world}x{local}", zero.label());
            let r = train(&cfg).unwrap_or_else(|e| panic!("{label}: {e}"));
            assert_eq!(r.summary.skipped_steps, 1, "{label}");
            assert!(r.steps[1].skipped && !r.steps[0].skipped && !r.steps[2].skipped, "{label}");
            assert!(!r.steps[1].grad_norm.is_finite(), "{label}");
            assert!(r.summary.final_loss.is_finite(), "{label}");
            // The skipped step changed nothing: two steps with step 1 skipped leave
            // the same parameters, bit for bit, as one clean step.
            let mut one = {
                let b = cfg.clone();
                TrainConfig { run: RunConfig { steps: 2, ..b.run }, ..b }
            };
            let skipped = train(&one).unwrap_or_else(|e| panic!("{label}: {e}")).params.unwrap();
            one.run.steps = 1;
            one.run.faults = Faults::default();
            let clean = train(&one).unwrap_or_else(|e| panic!("{label}: {e}")).params.unwrap();
            let bits = |p: &[Vec<f32>]| p.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&skipped), bits(&clean), "{label}: the skipped step changed the parameters");
        }
    }
}

#[test]
fn bad_configs_and_data_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "abcdefghijkl").unwrap();
    let cases: Vec<(&str, TrainConfig)> = vec![
        ("empty", TrainConfig { data: DataChoice::File(empty), ..tiny(2, 2) }),
        ("missing", TrainConfig { data: DataChoice::File(dir.path().join("nope.txt")), ..tiny(2, 2) }),
        ("larger than the training data", TrainConfig { data: DataChoice::File(short), ..tiny(2, 2) }),
        ("not divisible into nodes", {
            let b = tiny(6, 4);
            TrainConfig { run: RunConfig { world: 6, ..b.run }, ..b }
        }),
        ("not divisible by world", {
            let mut c = tiny(4, 2);
            c.run.engine.global_batch = 6;
            c
        }),
        ("hpZ partition size", {
            let mut c = tiny(8, 4);
            c.run.engine.zero.hpz_size = 3;
            c
        }),
        ("stage", {
            let mut c = tiny(2, 2);
            c.run.engine.zero.stage = 2;
            c
        }),
        ("steps", {
            let b = tiny(2, 2);
            TrainConfig { run: RunConfig { steps: 0, ..b.run }, ..b }
        }),
    ];
    for (what, cfg) in cases {
        let err = train(&cfg).expect_err(what);
        let msg = err.to_string();
        eprintln!("{what}: {msg}");
        assert!(!msg.is_empty());
        if what != "missing" && what != "empty" {
            assert!(msg.contains(what), "{what}: {msg}");
        }
    }
}

#[test]
fn a_bad_deepspeed_config_is_an_error() {
    let bad =
        r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}"#;
    let e = zeropp_run::deepspeed::from_json_str(bad, 4, &EngineConfig::default()).unwrap_err();
    assert!(e.to_string().contains("train_batch_size 10"), "{e}");
}

/// With LoCo error feedback (opt-in), a skipped step resets the residuals to
/// zero instead of restoring a saved copy (there is none: it would double their
/// memory): the checkpoint written right after the skipped step holds zero
/// residuals, where the same run without the fault holds non-zero ones, and the
/// parameters are those of the clean steps alone.
#[test]
fn a_skipped_step_resets_the_loco_residuals() {
    use zeropp_engine::config::QgzConfig;
    use zeropp_engine::engine::{build_plan, checkpoint};
    let zero =
        ZeroConfig { qgz: Some(QgzConfig::loco(ZeroConfig::default_qgz_spec())), ..ZeroConfig::zeropp(4) };
    let residuals = |faults: Faults| -> Vec<f32> {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = {
            let b = tiny(8, 4);
            TrainConfig {
                run: RunConfig { faults, steps: 2, save: Some(dir.path().to_path_buf()), ..b.run },
                ..b
            }
        };
        cfg.run.engine.zero = zero;
        let r = train(&cfg).unwrap();
        assert_eq!(r.summary.skipped_steps, usize::from(faults.nan_gradient.is_some()));
        let info = zeropp_engine::data::load_data(&cfg.data).unwrap().1;
        let model = zeropp_engine::Gpt::new(GptConfig::tiny().with_vocab(info.vocab)).unwrap();
        let topo = zeropp_comm::Topology::ranks(8).per_node(4).unwrap();
        let plan = build_plan(&model, &cfg.run.engine, topo).unwrap();
        let (step, states) = checkpoint::load(dir.path(), &plan, &cfg.run.engine).unwrap();
        assert_eq!(step, 2);
        states
            .into_iter()
            .flat_map(|s| s.feedback.expect("LoCo residuals saved"))
            .flat_map(|(h1, h2)| h1.into_iter().chain(h2))
            .collect()
    };
    let clean = residuals(Faults::default());
    assert!(clean.iter().any(|&x| x != 0.0), "LoCo residuals stayed zero without a skip");
    // Step 1 (the last) is skipped on every rank.
    let skipped = residuals(Faults { nan_gradient: Some((3, 1)), ..Faults::default() });
    assert!(skipped.iter().all(|&x| x == 0.0), "a skipped step left LoCo residuals behind");
}
