//! The one-device cluster on a real GPU (`CudaDevice`, feature `cuda`): the
//! conformance suite unchanged, and the device ZeRO++ collectives bitwise equal to
//! the host ones on the thread backend (the same checks `device.rs` runs on
//! `HostDevice`).
//!
//! One `#[test]` runs every check, so that without a device the run prints
//! exactly one counted line (`gpu: N tests skipped: no usable CUDA device (CUDA cuInit failed: ...)`); with
//! `ZEROPP_REQUIRE_GPU=1` a missing device is a failure. Run it with
//! `cargo xtask gpu test` (it sets up the driver stub for linking).

use std::time::Duration;

use zeropp_comm::conformance::{Case, DevicePath, run_all, run_collectives};
use zeropp_comm::device::{CudaDevice, DeviceCluster};
use zeropp_comm::{ThreadOptions, Topology};

use super::device::{
    SHAPES, check_misaligned, device_feedback_steps, feedback_options, host_feedback_steps, misaligned_views,
    on_device, on_threads, thread_cluster,
};

type Check = fn(&CudaDevice);

const CHECKS: &[(&str, Check)] = &[
    ("conformance suite on the one-GPU cluster (communicator and device collectives)", conformance),
    ("qwZ, hpZ, qgZ and bf16 baselines on GPU buffers, bitwise vs the thread backend", bitwise),
    (
        "qgZ with LoCo error feedback (residuals on the GPU), three steps, bitwise vs the thread backend",
        feedback,
    ),
    (
        "views at misaligned offsets: f32/bf16 refused with the host's error, wire encodings realigned",
        misaligned,
    ),
];

fn cluster(dev: &CudaDevice, w: usize, l: usize) -> DeviceCluster<CudaDevice> {
    let opts = ThreadOptions::default().with_timeout(Duration::from_secs(60));
    DeviceCluster::new(Topology::ranks(w).per_node(l).unwrap(), dev.clone(), opts)
}

fn conformance(dev: &CudaDevice) {
    for (w, l) in [(1, 1), (2, 2), (4, 2), (8, 4)] {
        for len in [0, 5, 97] {
            let case = Case { seed: 42, len };
            let r =
                cluster(dev, w, l).run(|comm| run_all(comm, &case)).map(|_| ()).map_err(|e| e.to_string());
            assert_eq!(r, Ok(()), "world {w} local {l} len {len}");
            // The device collectives on GPU buffers, through the same checks.
            let r = cluster(dev, w, l)
                .run(|comm| {
                    run_collectives(&mut DevicePath(comm), &case).map_err(zeropp_comm::CommError::Mismatch)
                })
                .map(|_| ())
                .map_err(|e| e.to_string());
            assert_eq!(r, Ok(()), "device collectives, world {w} local {l} len {len}");
        }
    }
}

fn bitwise(dev: &CudaDevice) {
    for (w, l) in SHAPES {
        for n in [0, 13, 2048 * w + 5] {
            let expected = thread_cluster(w, l).run(|comm| on_threads(comm, n)).unwrap();
            let got = cluster(dev, w, l).run(|comm| on_device(comm, n)).unwrap();
            assert_eq!(expected, got, "world {w} local {l} n {n}");
        }
    }
}

fn feedback(dev: &CudaDevice) {
    for (w, l) in [(4, 2), (8, 4), (2, 1)] {
        for opts in feedback_options() {
            let n = 4096 * w + 3;
            let host = thread_cluster(w, l).run(|comm| host_feedback_steps(comm, n, &opts)).unwrap();
            let got = cluster(dev, w, l).run(|comm| device_feedback_steps(comm, n, &opts)).unwrap();
            assert_eq!(host, got, "world {w} local {l}");
        }
    }
}

fn misaligned(dev: &CudaDevice) {
    check_misaligned(cluster(dev, 2, 2).run(misaligned_views).unwrap());
}

#[test]
fn device_gpu_suite() {
    let banner = |dev: &CudaDevice| {
        format!("one-GPU cluster on {} ({})", dev.gpu().device_name().unwrap_or_default(), dev.gpu().image())
    };
    zeropp_tests::gpu::suite(CudaDevice::new(), banner, CHECKS);
}
