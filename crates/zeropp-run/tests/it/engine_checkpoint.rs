//! Checkpoint at step k + resume gives exactly the loss trajectory and the
//! parameters of an uninterrupted run.

use zeropp_engine::RunConfig;
use zeropp_engine::config::{CommDtype, EngineConfig, QgzConfig, ZeroConfig};
use zeropp_engine::data::DataChoice;
use zeropp_engine::model::GptConfig;
use zeropp_run::train::{ModelChoice, TrainConfig, train};

fn cfg(zero: ZeroConfig, steps: usize) -> TrainConfig {
    TrainConfig {
        model: ModelChoice::Gpt(GptConfig::tiny()),
        data: DataChoice::Markov { seed: 4, chars: 20_000 },
        run: RunConfig {
            world: 8,
            local_size: 4,
            engine: EngineConfig { zero, global_batch: 16, grad_accum: 2, ..EngineConfig::default() },
            steps,
            eval_batches: 1,
            keep_params: true,
            ..RunConfig::default()
        },
    }
}

#[test]
fn resume_reproduces_the_uninterrupted_run() {
    for zero in [
        ZeroConfig::zeropp(4),
        ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() },
        // The stochastic-rounding streams are keyed by the step, so a resume draws
        // exactly what the uninterrupted run drew.
        ZeroConfig { stochastic_rounding: true, ..ZeroConfig::zeropp(4) },
        // The LoCo residuals are saved with the checkpoint (bf16, the default
        // storage, and f32).
        ZeroConfig { qgz: Some(QgzConfig::loco(ZeroConfig::default_qgz_spec())), ..ZeroConfig::zeropp(4) },
        ZeroConfig {
            qgz: Some(QgzConfig {
                error_feedback: Some(zeropp_engine::config::LocoConfig {
                    residual_dtype: zeropp_engine::config::ResidualPrecision::F32,
                    ..Default::default()
                }),
                ..QgzConfig::loco(ZeroConfig::default_qgz_spec())
            }),
            ..ZeroConfig::zeropp(4)
        },
        // The bucket knobs: a persistent bucket, and reduces split into pieces
        // (each with its own LoCo residuals).
        ZeroConfig {
            buckets: zeropp_engine::config::BucketKnobs {
                param_persistence_threshold: 64,
                reduce_bucket_size: Some(8 * 256),
                ..Default::default()
            },
            ..ZeroConfig::zeropp(4)
        },
    ] {
        let dir = tempfile::tempdir().unwrap();
        let full = train(&cfg(zero, 10)).unwrap();

        // Run 6 steps saving every 3, then resume from the latest (step 6) to 10.
        let first = train(&{
            let b = cfg(zero, 6);
            TrainConfig {
                run: RunConfig { save: Some(dir.path().to_path_buf()), save_every: 3, ..b.run },
                ..b
            }
        })
        .unwrap();
        assert!(dir.path().join("LATEST").exists());
        let resumed = train(&{
            let b = cfg(zero, 10);
            TrainConfig { run: RunConfig { resume: Some(dir.path().to_path_buf()), ..b.run }, ..b }
        })
        .unwrap();

        let bits = |r: &[zeropp_engine::metrics::StepRecord]| {
            r.iter().map(|s| (s.step, s.loss.to_bits())).collect::<Vec<_>>()
        };
        assert_eq!(bits(&first.steps), bits(&full.steps[..6]), "{zero:?}");
        assert_eq!(bits(&resumed.steps), bits(&full.steps[6..]), "{zero:?}");
        assert_eq!(resumed.params, full.params, "{zero:?}");
        assert_eq!(resumed.summary.val_loss, full.summary.val_loss);

        // Resume from an earlier checkpoint folder (step 3) too.
        let step3 = dir.path().join("step-00000003");
        let from3 = train(&{
            let b = cfg(zero, 10);
            TrainConfig { run: RunConfig { resume: Some(step3), ..b.run }, ..b }
        })
        .unwrap();
        assert_eq!(bits(&from3.steps), bits(&full.steps[3..]));
    }
}

#[test]
fn resume_on_another_world_size_continues_training() {
    let dir = tempfile::tempdir().unwrap();
    let z = ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() };
    let full = train(&cfg(z, 8)).unwrap();
    train(&{
        let b = cfg(z, 4);
        TrainConfig { run: RunConfig { save: Some(dir.path().to_path_buf()), ..b.run }, ..b }
    })
    .unwrap();
    // Re-shard 8 ranks -> 4 ranks (2 x 2): same global batches, same math up to rounding.
    let mut c = cfg(z, 8);
    c.run.world = 4;
    c.run.local_size = 2;
    c.run.resume = Some(dir.path().to_path_buf());
    let r = train(&c).unwrap();
    for (a, b) in r.steps.iter().zip(&full.steps[4..]) {
        assert!((a.loss - b.loss).abs() / b.loss < 1e-5, "{} vs {}", a.loss, b.loss);
    }
}

#[test]
fn resume_from_nothing_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let e = train(&{
        let b = cfg(ZeroConfig::zero3(), 2);
        TrainConfig { run: RunConfig { resume: Some(dir.path().to_path_buf()), ..b.run }, ..b }
    })
    .unwrap_err();
    assert!(e.to_string().contains("checkpoint"), "{e}");
}
