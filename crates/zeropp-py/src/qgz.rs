//! qgZ for Python: the transport-free stages, the slice order and the wire sizes.

use pyo3::prelude::*;
use zeropp_comm::collectives::{QgzOptions, QgzStages, Reduce, qgz_bytes};
use zeropp_comm::{CommError, Topology};

use crate::buffers::{Buf, Dtype, check_disjoint, elems, f32_mut, f32_ref};
use crate::convert::{error, options, rust_err, spec};
use crate::layout::{ChunkLayout, LaidOut};

fn topology(world: usize, local_size: usize) -> PyResult<Topology> {
    Topology::ranks(world).per_node(local_size).map_err(rust_err)
}

/// The options of one call; `intra_bits` is the intra-node hop's width when it
/// differs from `bits` (SDP4Bit's two levels), `hadamard` the rotation's seed.
#[allow(clippy::too_many_arguments)] // the Python signature's keyword arguments
fn qgz_options(
    bits: u32,
    group_size: usize,
    local_bits: u32,
    intra_bits: Option<u32>,
    hadamard: Option<u64>,
    seed: Option<u64>,
    mean: bool,
    propagate: bool,
) -> PyResult<QgzOptions> {
    let mut o = QgzOptions::default().with_spec(spec(bits, group_size, true)?);
    o.intra_spec = spec(intra_bits.unwrap_or(bits), group_size, true)?;
    o.hadamard = hadamard;
    o.local_spec = spec(local_bits, group_size, true)?;
    o.quant = options(seed, propagate);
    o.reduce = if mean { Reduce::Mean } else { Reduce::Sum };
    Ok(o)
}

/// QgzStages(world, local_size, rank, n, *, bits=4, group_size=256, local_bits=8, seed=None, mean=True,
///           intra_bits=None, hadamard=None, propagate=False)
///
/// The local stages of one qgZ reduce-scatter of an `n`-element float32
/// gradient, for rank `rank` of `world = nodes × local_size` ranks (node-major:
/// rank = node·local_size + local rank). Run `pack`, an all-to-all of
/// `intra_send` in the node (chunks of `intra_chunk_len` bytes, in local-rank
/// order), `reduce_intra`, an all-to-all of `inter_send` over the rail (the
/// ranks with the same local rank; chunks of `inter_chunk_len` bytes, in node
/// order), then `finish`; the shard (`shard_len` float32 elements) then holds
/// this rank's part of the mean (or sum) over all ranks. These are the Rust
/// engine's own stages: same slice order, same rounding streams for a `seed`
/// (the engine derives one per call with `stream_seed`), same result.
/// `intra_bits=8` sends the intra-node hop at INT8 and only the inter-node one
/// at `bits` (SDP4Bit's two levels); `hadamard=SEED` rotates each group before
/// its first quantization and the shard back at `finish` (the group size must
/// then be a power of two; every rank passes the same seed). `propagate=True`
/// lets a NaN or ±Inf in the gradient through as NaN over its quantization
/// group of the owner's shard (FSDP2's contract: the user's own check sees
/// it), where the default fails the stage. `pack_layout` reads FSDP2's chunks
/// through a `ChunkLayout` instead of a flat float32 gradient.
#[pyclass(name = "QgzStages", module = "zeropp._zeropp", frozen)]
pub(crate) struct Stages {
    inner: QgzStages,
    /// The gradient's elements.
    n: usize,
}

#[pymethods]
impl Stages {
    #[new]
    #[pyo3(signature = (world, local_size, rank, n, *, bits = 4, group_size = 256, local_bits = 8, seed = None, mean = true, intra_bits = None, hadamard = None, propagate = false))]
    #[allow(clippy::too_many_arguments)] // a Python signature with keyword arguments
    fn new(
        world: usize,
        local_size: usize,
        rank: usize,
        n: usize,
        bits: u32,
        group_size: usize,
        local_bits: u32,
        seed: Option<u64>,
        mean: bool,
        intra_bits: Option<u32>,
        hadamard: Option<u64>,
        propagate: bool,
    ) -> PyResult<Self> {
        let o = qgz_options(bits, group_size, local_bits, intra_bits, hadamard, seed, mean, propagate)?;
        Ok(Self { inner: QgzStages::new(&topology(world, local_size)?, rank, n, &o).map_err(rust_err)?, n })
    }

    /// Elements of the output shard: ceil(n / world).
    #[getter]
    fn shard_len(&self) -> usize {
        self.inner.shard_len()
    }

    /// Bytes per local peer in the intra-node all-to-all (0 without one).
    #[getter]
    fn intra_chunk_len(&self) -> usize {
        self.inner.intra_chunk_len()
    }

    /// Bytes of the chunk this rank keeps (at local_bits; 0 without an intra hop).
    #[getter]
    fn own_len(&self) -> usize {
        self.inner.own_len()
    }

    /// Bytes per rail peer in the inter-node all-to-all (0 with one node).
    #[getter]
    fn inter_chunk_len(&self) -> usize {
        self.inner.inter_chunk_len()
    }

    /// pack(grad, intra_send, own, inter_send, shard): stage 1, reorder and quantize.
    fn pack(
        &self,
        py: Python<'_>,
        grad: &Bound<'_, PyAny>,
        intra_send: &Bound<'_, PyAny>,
        own: &Bound<'_, PyAny>,
        inter_send: &Bound<'_, PyAny>,
        shard: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let g = Buf::get(grad, "grad", false)?;
        let grad = f32_ref(&g)?;
        self.pack_into(py, &g, [intra_send, own, inter_send, shard], |st, a, o, i, s| {
            st.pack(grad, a, o, i, s)
        })
    }

    /// pack_layout(x, layout, intra_send, own, inter_send, shard, *, dtype): stage 1
    /// with the gradient read through `layout` (a `ChunkLayout`) from `x`, the
    /// `world` chunks of FSDP2's reduce-scatter input (`world x layout.c`
    /// elements of `dtype`): the same bytes as `pack` of the float32 vector
    /// `layout.gather` would make (`n` must be `world x layout.cq`), without it.
    #[pyo3(signature = (x, layout, intra_send, own, inter_send, shard, *, dtype))]
    #[allow(clippy::too_many_arguments)] // a Python signature with keyword arguments
    fn pack_layout(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        layout: &Bound<'_, ChunkLayout>,
        intra_send: &Bound<'_, PyAny>,
        own: &Bound<'_, PyAny>,
        inter_send: &Bound<'_, PyAny>,
        shard: &Bound<'_, PyAny>,
        dtype: &str,
    ) -> PyResult<()> {
        let dtype = Dtype::parse(dtype)?;
        let lay = layout.get();
        let rows = self.inner.topology().world();
        let g = Buf::get(x, "x", false)?;
        if dtype.count(&g)? != rows * lay.chunk_len() || rows * lay.quantized_len() != self.n {
            return Err(error(format!(
                "pack_layout: x has {} elements and the stages reduce {}, but the layout makes {rows} chunks of {}                  elements into {rows} x {}",
                dtype.count(&g)?,
                self.n,
                lay.chunk_len(),
                lay.quantized_len()
            )));
        }
        let src = LaidOut { x: elems(&g, dtype)?, layout: lay, rows };
        let outs = [intra_send, own, inter_send, shard];
        self.pack_into(py, &g, outs, |st, a, o, i, s| st.pack_from(&src, a, o, i, s))
    }

    /// reduce_intra(intra_recv, own, inter_send, shard): stage 3, the fused reduce.
    fn reduce_intra(
        &self,
        py: Python<'_>,
        intra_recv: &Bound<'_, PyAny>,
        own: &Bound<'_, PyAny>,
        inter_send: &Bound<'_, PyAny>,
        shard: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let r = Buf::get(intra_recv, "intra_recv", false)?;
        let o = Buf::get(own, "own", false)?;
        let i = Buf::get(inter_send, "inter_send", true)?;
        let s = Buf::get(shard, "shard", true)?;
        check_disjoint(&[&r, &o, &i, &s])?;
        let (r, o, i, s) = (r.bytes(), o.bytes(), i.bytes_mut()?, f32_mut(&s)?);
        let st = &self.inner;
        py.detach(|| st.reduce_intra(r, o, i, s)).map_err(rust_err)
    }

    /// finish(inter_recv, shard): stage 5, add the other nodes' partials and average.
    fn finish(
        &self,
        py: Python<'_>,
        inter_recv: &Bound<'_, PyAny>,
        shard: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let r = Buf::get(inter_recv, "inter_recv", false)?;
        let s = Buf::get(shard, "shard", true)?;
        check_disjoint(&[&r, &s])?;
        let (r, s) = (r.bytes(), f32_mut(&s)?);
        let st = &self.inner;
        py.detach(|| st.finish(r, s)).map_err(rust_err)
    }
}

/// The stage-1 outputs and their names, in `pack`'s order.
const PACK_OUT: [&str; 4] = ["intra_send", "own", "inter_send", "shard"];

impl Stages {
    /// Stage 1 into `outs` (`intra_send`, `own`, `inter_send` as bytes, `shard`
    /// as float32), once none overlaps another or the input `g`; `run` packs
    /// without the GIL.
    fn pack_into(
        &self,
        py: Python<'_>,
        g: &Buf,
        outs: [&Bound<'_, PyAny>; 4],
        run: impl FnOnce(&QgzStages, &mut [u8], &mut [u8], &mut [u8], &mut [f32]) -> Result<(), CommError> + Send,
    ) -> PyResult<()> {
        let [a, o, i, s] = [0, 1, 2, 3].map(|k| Buf::get(outs[k], PACK_OUT[k], true));
        let (a, o, i, s) = (a?, o?, i?, s?);
        check_disjoint(&[g, &a, &o, &i, &s])?;
        let (a, o, i, s) = (a.bytes_mut()?, o.bytes_mut()?, i.bytes_mut()?, f32_mut(&s)?);
        let st = &self.inner;
        py.detach(|| run(st, a, o, i, s)).map_err(rust_err)
    }
}

/// qgz_slice_order(world, local_size, rank) -> list[list[int]]
///
/// qgZ's slice reordering for `rank`: entry `j` lists, in order, the shards
/// (by owning rank) packed into the chunk sent to local peer `j`, i.e. the
/// shards of the ranks with local rank `j`, one per node.
#[pyfunction]
fn qgz_slice_order(world: usize, local_size: usize, rank: usize) -> PyResult<Vec<Vec<usize>>> {
    let t = topology(world, local_size)?;
    if rank >= world {
        return Err(error(format!("rank {rank} outside a world of {world}")));
    }
    Ok((0..t.local_size()).map(|j| (0..t.nodes()).map(|m| t.rank_of(m, j)).collect()).collect())
}

/// qgz_wire_bytes(world, local_size, n, *, bits=4, group_size=256, intra_bits=None) -> (intra, inter)
///
/// Bytes one rank sends in a qgZ reduce-scatter of `n` elements: to its local
/// peers (at `intra_bits` when given), and across nodes to its rail peers.
#[pyfunction]
#[pyo3(signature = (world, local_size, n, *, bits = 4, group_size = 256, intra_bits = None))]
fn qgz_wire_bytes(
    world: usize,
    local_size: usize,
    n: usize,
    bits: u32,
    group_size: usize,
    intra_bits: Option<u32>,
) -> PyResult<(u64, u64)> {
    let o = qgz_options(bits, group_size, 8, intra_bits, None, None, true, false)?;
    let b = qgz_bytes(&topology(world, local_size)?, &o, n);
    Ok((b.intra, b.inter))
}

/// Adds the class and functions to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Stages>()?;
    m.add_function(wrap_pyfunction!(qgz_slice_order, m)?)?;
    m.add_function(wrap_pyfunction!(qgz_wire_bytes, m)?)?;
    Ok(())
}
