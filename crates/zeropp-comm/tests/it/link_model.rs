//! The link model: parsing, and measured transfer times against the model.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use std::time::{Duration, Instant};

use zeropp_comm::{CommExt, Communicator, Group, LinkModel, ThreadCluster, ThreadOptions, Topology};

#[test]
fn parses_units() {
    let m: LinkModel = "intra=100GB/s,inter=12.5GB/s,latency=5us".parse().unwrap();
    assert_eq!(m.intra.bandwidth_bytes_per_s, 100e9);
    assert_eq!(m.inter.latency, Duration::from_micros(5));
    let m: LinkModel = "intra=1Gbit/s, inter=200MB/s, intra_latency=1ms, inter_latency=0".parse().unwrap();
    assert_eq!(m.intra.bandwidth_bytes_per_s, 125e6);
    assert_eq!(m.inter.bandwidth_bytes_per_s, 200e6);
    assert_eq!(m.intra.latency, Duration::from_millis(1));
    assert_eq!(m.inter.latency, Duration::ZERO);
    for bad in [
        "",
        "intra=1GB/s",
        "intra=1GB/s,inter=x",
        "intra=1GB/s,inter=1furlong/s",
        "intra=0GB/s,inter=1GB/s",
        "intra=1GB/s,inter=1GB/s,latency=-1us",
        "foo=1",
    ] {
        assert!(bad.parse::<LinkModel>().is_err(), "{bad}");
    }
    let m: LinkModel = "intra=3GB/s,inter=1.5GB/s,latency=7us".parse().unwrap();
    assert_eq!(m.to_string().parse::<LinkModel>().unwrap(), m);
}

/// The cluster corrections: a shared node uplink divides the rate, TCP framing takes
/// its 66 of every 1514 bytes, and only the inter-node class changes.
#[test]
fn shared_uplink_and_tcp_framing() {
    let plain: LinkModel = "intra=10GB/s,inter=100Mbit/s,latency=1ms".parse().unwrap();
    let shared: LinkModel = "intra=10GB/s,inter=100Mbit/s,latency=1ms,inter_share=4".parse().unwrap();
    let tcp: LinkModel = "intra=10GB/s,inter=100Mbit/s,latency=1ms,inter_framing=tcp".parse().unwrap();
    let both: LinkModel =
        "inter_framing=tcp,inter_share=2,intra=10GB/s,inter=100Mbit/s,latency=1ms".parse().unwrap();
    assert_eq!(plain.inter.bandwidth_bytes_per_s, 12.5e6);
    assert_eq!(shared.inter.bandwidth_bytes_per_s, 12.5e6 / 4.0);
    assert_eq!(tcp.inter.bandwidth_bytes_per_s, 12.5e6 * 1448.0 / 1514.0);
    assert_eq!(both.inter.bandwidth_bytes_per_s, 12.5e6 / 2.0 * 1448.0 / 1514.0);
    for m in [&shared, &tcp, &both] {
        assert_eq!(m.intra, plain.intra);
        assert_eq!(m.inter.latency, plain.inter.latency);
    }
    assert_eq!(
        "intra=1GB/s,inter=1GB/s,inter_share=1,inter_framing=none".parse::<LinkModel>().unwrap(),
        "intra=1GB/s,inter=1GB/s".parse::<LinkModel>().unwrap()
    );
    for bad in ["inter_share=0", "inter_share=-2", "inter_share=1.5", "inter_framing=udp"] {
        let s = format!("intra=1GB/s,inter=1GB/s,{bad}");
        assert!(s.parse::<LinkModel>().is_err(), "{s}");
    }
}

fn timed(
    model: &str,
    world: usize,
    local: usize,
    f: impl Fn(&mut zeropp_comm::ThreadComm) + Sync,
) -> Duration {
    let t = Topology::ranks(world).per_node(local).unwrap();
    let c = ThreadCluster::new(t, ThreadOptions::default().with_link_model(model.parse().unwrap()));
    let times = c
        .run(|comm| -> Result<Duration, zeropp_comm::CommError> {
            comm.barrier(&Group::world(comm.topology()))?;
            let start = Instant::now();
            f(comm);
            Ok(start.elapsed())
        })
        .unwrap();
    times.into_iter().max().unwrap()
}

#[test]
fn transfer_time_follows_the_model() {
    // 8 MB over a 100 MB/s inter-node link with 2 ms latency: 82 ms.
    let bytes = 8_000_000;
    let el = timed("intra=10GB/s,inter=100MB/s,latency=2ms", 2, 1, |comm| {
        let mut buf = vec![0u8; bytes];
        comm.broadcast_bytes(&Group::world(comm.topology()), 0, &mut buf).unwrap();
    });
    let model = Duration::from_millis(82);
    assert!(el >= model, "{el:?} < {model:?}");
    assert!(el < model * 2, "{el:?} far above {model:?}");

    // All-gather on 2 nodes x 2: each rank sends 1 MB to its local peer (intra,
    // 1 GB/s: 1 ms) and 1 MB to each of two remote ranks (inter, 100 MB/s, queued
    // on one port: 20 ms). The slowest transfer bounds the step.
    let el = timed("intra=1GB/s,inter=100MB/s", 4, 2, |comm| {
        let mut all = vec![0u8; 4_000_000];
        comm.all_gather(&Group::world(comm.topology()), &vec![1u8; 1_000_000], &mut all).unwrap();
    });
    assert!(el >= Duration::from_millis(20), "{el:?}");
    assert!(el < Duration::from_millis(60), "{el:?}");
}
