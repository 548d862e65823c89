//! [`QgzStages`], the transport-free qgZ, run by hand (the two all-to-alls done
//! by copying bytes between the ranks' buffers) gives the same shards, bit for
//! bit, as [`qgz_reduce_scatter`] on the thread backend: the Python bindings
//! rely on this to reduce exactly like the engine.

use proptest::prelude::*;
use zeropp_comm::collectives::{PartFn, PartSource, QgzOptions, QgzStages, qgz_reduce_scatter, shard_len};
use zeropp_comm::{CommError, ThreadCluster, ThreadOptions, Topology};
use zeropp_quant::NonFinite;
use zeropp_quant::rng::splitmix64;

fn grad(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let u = (splitmix64((rank * 1_000_003 + i) as u64) >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * u - 1.0) * (1.0 + (i % 7) as f32)
        })
        .collect()
}

/// All ranks' shards through the stages, with the all-to-alls done by hand.
fn by_hand(t: &Topology, n: usize, opts: &QgzOptions) -> Vec<Vec<f32>> {
    by_hand_of(t, n, opts, &|r| grad(r, n)).unwrap()
}

/// [`by_hand`] of the gradients `g(rank)`; the first stage error, if any.
fn by_hand_of(
    t: &Topology,
    n: usize,
    opts: &QgzOptions,
    g: &dyn Fn(usize) -> Vec<f32>,
) -> Result<Vec<Vec<f32>>, zeropp_comm::CommError> {
    let (w, nodes, local) = (t.world(), t.nodes(), t.local_size());
    let st: Vec<QgzStages> = (0..w).map(|r| QgzStages::new(t, r, n, opts).unwrap()).collect();
    let (ia, ie) = (st[0].intra_chunk_len(), st[0].inter_chunk_len());
    let mut intra_send = vec![vec![0u8; local * ia]; w];
    let mut own = vec![vec![0u8; st[0].own_len()]; w];
    let mut inter_send = vec![vec![0u8; nodes * ie]; w];
    let mut shard = vec![vec![0f32; shard_len(n, w)]; w];
    for r in 0..w {
        st[r].pack(&g(r), &mut intra_send[r], &mut own[r], &mut inter_send[r], &mut shard[r])?;
    }
    // Intra-node all-to-all: rank (m, l) receives chunk l of each local peer (m, j), at slot j.
    for r in 0..w {
        let (m, l) = (t.node_of(r), t.local_rank(r));
        let mut recv = vec![0u8; local * ia];
        for j in 0..local {
            let src = &intra_send[t.rank_of(m, j)][l * ia..(l + 1) * ia];
            recv[j * ia..(j + 1) * ia].copy_from_slice(src);
        }
        st[r].reduce_intra(&recv, &own[r], &mut inter_send[r], &mut shard[r])?;
    }
    // Rail all-to-all: rank (m, l) receives chunk m of each rail peer (m', l), at slot m'.
    for r in 0..w {
        let (m, l) = (t.node_of(r), t.local_rank(r));
        let mut recv = vec![0u8; nodes * ie];
        for k in 0..nodes {
            recv[k * ie..(k + 1) * ie].copy_from_slice(&inter_send[t.rank_of(k, l)][m * ie..(m + 1) * ie]);
        }
        st[r].finish(&recv, &mut shard[r])?;
    }
    Ok(shard)
}

fn on_threads(t: &Topology, n: usize, opts: &QgzOptions) -> Vec<Vec<f32>> {
    let opts = *opts;
    ThreadCluster::new(*t, ThreadOptions::default())
        .run(move |comm| {
            let mut shard = vec![0f32; shard_len(n, comm.topology().world())];
            qgz_reduce_scatter(comm, &grad(comm.rank(), n), &mut shard, &opts)?;
            Ok::<_, zeropp_comm::CommError>(shard)
        })
        .unwrap()
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter().map(|s| s.iter().map(|x| x.to_bits()).collect()).collect()
}

/// A property case's cluster (`nodes x local`) and options: plain qgZ, or
/// SDP4Bit's two levels rotated when `hadamard` gives a seed (groups of 64:
/// short shards still rotate), with stochastic rounding when `seed` does.
fn case(shape: (usize, usize), seed: Option<u64>, hadamard: Option<u64>) -> (Topology, QgzOptions) {
    let t = Topology::ranks(shape.0 * shape.1).per_node(shape.1).unwrap();
    let mut opts = QgzOptions::default();
    if let Some(h) = hadamard {
        opts = QgzOptions::two_level(64).unwrap().with_hadamard(h);
    }
    if let Some(seed) = seed {
        opts.quant = opts.quant.stochastic(seed);
    }
    (t, opts)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn stages_by_hand_equal_the_collective(
        shape in prop::sample::select(vec![(1, 1), (1, 3), (3, 1), (2, 2), (2, 3), (3, 2)]),
        n in 1usize..3000,
        seed in prop::option::of(any::<u64>()),
        hadamard in prop::option::of(any::<u64>()),
    ) {
        let (t, opts) = case(shape, seed, hadamard);
        prop_assert_eq!(bits(&by_hand(&t, n, &opts)), bits(&on_threads(&t, n, &opts)));
    }
}

/// A gradient kept as separate shards, each served from its own vector (not
/// one flat slice), as a caller with its own layout would.
struct Sharded(Vec<Vec<f32>>, usize);

impl PartSource for Sharded {
    fn len(&self) -> usize {
        self.1
    }
    fn with_part(&self, part: usize, s: usize, f: &mut PartFn<'_>) -> Result<(), CommError> {
        let mut x = self.0.get(part).cloned().unwrap_or_default();
        x.resize(s, 0.0);
        f(&x)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// `pack_from` a source of shards writes the bytes `pack` of the flat
    /// gradient writes, in every buffer.
    #[test]
    fn pack_from_a_source_equals_pack(
        shape in prop::sample::select(vec![(1, 1), (1, 3), (3, 1), (2, 2), (2, 3)]),
        n in 1usize..3000,
        seed in prop::option::of(any::<u64>()),
        hadamard in prop::option::of(any::<u64>()),
    ) {
        let (t, opts) = case(shape, seed, hadamard);
        let w = t.world();
        for r in 0..w {
            let st = QgzStages::new(&t, r, n, &opts).unwrap();
            let g = grad(r, n);
            let s = st.shard_len();
            let src = Sharded(g.chunks(s).map(<[f32]>::to_vec).collect(), n);
            let bufs = || (
                vec![0u8; t.local_size() * st.intra_chunk_len()],
                vec![0u8; st.own_len()],
                vec![0u8; t.nodes() * st.inter_chunk_len()],
                vec![0f32; s],
            );
            let (mut a1, mut o1, mut i1, mut s1) = bufs();
            let (mut a2, mut o2, mut i2, mut s2) = bufs();
            st.pack(&g, &mut a1, &mut o1, &mut i1, &mut s1).unwrap();
            st.pack_from(&src, &mut a2, &mut o2, &mut i2, &mut s2).unwrap();
            prop_assert_eq!(a1, a2);
            prop_assert_eq!(o1, o2);
            prop_assert_eq!(i1, i2);
            prop_assert_eq!(bits(&[s1]), bits(&[s2]));
        }
    }

    /// With `NonFinite::Propagate`, a NaN or ±Inf in one rank's gradient
    /// reaches the rank that owns its element: that element's quantization
    /// group (of the owner's shard) is NaN, every other element of every shard
    /// is finite, and no stage fails. Without it, the first stage refuses.
    #[test]
    fn a_non_finite_gradient_reaches_its_owner(
        shape in prop::sample::select(vec![(1, 2), (2, 1), (2, 2), (2, 3), (3, 2)]),
        n in 1usize..3000,
        at in any::<prop::sample::Index>(),
        from in any::<prop::sample::Index>(),
        bad in prop::sample::select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY]),
        two_level in any::<bool>(),
        hadamard in prop::option::of(any::<u64>()),
        seed in prop::option::of(any::<u64>()),
    ) {
        let t = Topology::ranks(shape.0 * shape.1).per_node(shape.1).unwrap();
        let gs = 64;
        let mut opts = if two_level { QgzOptions::two_level(gs).unwrap() } else {
            QgzOptions::default().with_spec(zeropp_quant::QuantSpec::int4(gs).unwrap())
        };
        opts.local_spec = zeropp_quant::QuantSpec::int8(gs).unwrap();
        if let Some(h) = hadamard {
            opts = opts.with_hadamard(h);
        }
        if let Some(seed) = seed {
            opts.quant = opts.quant.stochastic(seed);
        }
        let (w, p, r0) = (t.world(), at.index(n), from.index(t.world()));
        let g = |r: usize| {
            let mut x = grad(r, n);
            if r == r0 {
                x[p] = bad;
            }
            x
        };
        let s = shard_len(n, w);
        let (owner, i) = (p / s, p % s);
        // With one rank per node the owner adds its own shard exactly, unquantized:
        // then only the element itself need be NaN (a rotation may spread it).
        let quantized = t.local_size() > 1 || owner != r0;
        if quantized {
            prop_assert!(by_hand_of(&t, n, &opts, &g).is_err(), "the default refuses the input");
        }
        opts.quant = opts.quant.with_non_finite(NonFinite::Propagate);
        let shards = by_hand_of(&t, n, &opts, &g).unwrap();
        let group = (i / gs) * gs..((i / gs + 1) * gs).min(s);
        for (r, shard) in shards.iter().enumerate() {
            for (k, v) in shard.iter().enumerate() {
                // Real elements of the poisoned group (the padding is zeroed).
                let in_group = r == owner && group.contains(&k) && r * s + k < n;
                if in_group && quantized {
                    prop_assert!(v.is_nan(), "rank {} element {}: {} (bad at {} from rank {})", r, k, v, p, r0);
                } else if in_group && k == i {
                    prop_assert!(!v.is_finite(), "rank {} element {}: {} (bad at {})", r, k, v, p);
                } else if !in_group {
                    prop_assert!(v.is_finite(), "rank {} element {}: {} (bad at {} from rank {})", r, k, v, p, r0);
                }
            }
        }
    }
}

#[test]
fn stages_name_the_buffer_that_does_not_fit() {
    let t = Topology::ranks(4).per_node(2).unwrap();
    let st = QgzStages::new(&t, 1, 1000, &QgzOptions::default()).unwrap();
    let g = vec![0.5f32; 1000];
    let mut shard = vec![0f32; st.shard_len()];
    let mut own = vec![0u8; st.own_len()];
    let mut inter = vec![0u8; 2 * st.inter_chunk_len()];
    let mut short = vec![0u8; 2 * st.intra_chunk_len() - 1];
    let e = st.pack(&g, &mut short, &mut own, &mut inter, &mut shard).unwrap_err().to_string();
    assert!(e.contains("intra-node send buffer"), "{e}");
    let e = st.pack(&g[..999], &mut short, &mut own, &mut inter, &mut shard).unwrap_err().to_string();
    assert!(e.contains("gradient"), "{e}");
    // Garbage where an encoding should be is a decode error, not a wrong sum.
    let recv = vec![7u8; 2 * st.intra_chunk_len()];
    assert!(st.reduce_intra(&recv, &own, &mut inter, &mut shard).is_err());
    assert!(QgzStages::new(&t, 4, 1000, &QgzOptions::default()).is_err());
    // The rotation needs one power-of-two group size on every hop.
    let mixed = QgzOptions {
        local_spec: zeropp_quant::QuantSpec::int8(128).unwrap(),
        ..QgzOptions::two_level(64).unwrap()
    };
    let e = QgzStages::new(&t, 1, 1000, &mixed.with_hadamard(1)).unwrap_err().to_string();
    assert!(e.contains("one group size for every hop (intra 64, inter 64, local 128)"), "{e}");
    let odd = QgzOptions::default().with_spec(zeropp_quant::QuantSpec::int4(100).unwrap());
    let odd = QgzOptions { local_spec: zeropp_quant::QuantSpec::int8(100).unwrap(), ..odd };
    let e = QgzStages::new(&t, 1, 1000, &odd.with_hadamard(1)).unwrap_err().to_string();
    assert!(e.contains("power-of-two group size"), "{e}");
}
