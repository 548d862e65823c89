//! `ChunkLayout`: PyTorch FSDP2's per-rank chunk of a module's flat buffer,
//! translated into the vectors zeropp's collectives reduce.
//!
//! FSDP2 concatenates a module's parameter shards into one chunk per rank
//! (`[(elements, is_1d), ...]`, one entry per parameter). zeropp reduces the
//! matrices through qgZ with every parameter starting on a quantization-group
//! boundary (so no group holds two parameters: per-tensor scales, as the Rust
//! engine's `per_tensor_groups`), and the 1-D parameters (biases, norm gains)
//! exactly. The layout maps between the two without index tensors: it is a
//! list of segments, and every copy is a slice copy (with the dtype
//! conversion) done in Rust with the GIL released.

use pyo3::prelude::*;
use zeropp_comm::CommError;
use zeropp_comm::collectives::{PartFn, PartSource};
use zeropp_quant::Element;

use crate::buffers::{
    Buf, Dtype, Elems, ElemsMut, check_disjoint, elems, elems_mut, f32_mut, f32_ref, in_out,
};
use crate::convert::error;

/// One parameter of the chunk: `n` elements at `at`, placed at `to` of the
/// quantized vector, or of the exact vector when `exact`.
#[derive(Debug, Clone, Copy)]
struct Seg {
    at: usize,
    n: usize,
    exact: bool,
    to: usize,
}

/// ChunkLayout(segments, *, align, exclude_1d=True)
///
/// The layout of one rank's chunk of an FSDP2 module (`segments`: one
/// `(elements, is_1d)` per parameter, in FSDP2's order; they cover the chunk's
/// `c` elements). The quantized vector (`cq` elements) holds every parameter
/// that is not 1-D (all of them with `exclude_1d=False`) from an `align`
/// boundary on, zeros in between; the exact vector (`exact_len` elements)
/// holds the 1-D ones back to back. `align=1` places the parameters back to
/// back (then the quantized vector is the chunk itself when nothing is 1-D).
///
/// Methods copy between the layouts for `rows` chunks at once (FSDP2's
/// reduce-scatter input is `world` chunks, rank-major): `gather`, `exact` and
/// `scatter`; `QgzStages.pack_layout` reads the chunks through the layout
/// without a copy of the whole gradient.
///
/// >>> from zeropp import _zeropp
/// >>> lay = _zeropp.ChunkLayout([(5, False), (2, True), (3, False)], align=4)
/// >>> (lay.c, lay.cq, lay.exact_len)
/// (10, 12, 2)
#[pyclass(name = "ChunkLayout", module = "zeropp._zeropp", frozen)]
pub(crate) struct ChunkLayout {
    segs: Vec<Seg>,
    c: usize,
    cq: usize,
    exact_len: usize,
}

impl ChunkLayout {
    /// The elements of the chunk (`c`).
    pub(crate) fn chunk_len(&self) -> usize {
        self.c
    }

    /// The quantized vector's length (`cq`).
    pub(crate) fn quantized_len(&self) -> usize {
        self.cq
    }

    /// Whether the quantized vector is the chunk itself (no 1-D parameter, no gap).
    fn is_identity(&self) -> bool {
        self.exact_len == 0 && self.cq == self.c && self.segs.iter().all(|s| s.at == s.to)
    }

    /// Writes chunk `row`'s quantized vector into `out` (`cq` elements; gaps zero).
    fn fill_row<T: Element>(&self, x: &[T], row: usize, out: &mut [f32]) {
        out.fill(0.0);
        let base = row * self.c;
        for s in self.segs.iter().filter(|s| !s.exact) {
            T::to_f32_slice(&x[base + s.at..base + s.at + s.n], &mut out[s.to..s.to + s.n]);
        }
    }

    /// Checks that `elements` is `rows` times `per_row`.
    fn check(what: &str, elements: usize, rows: usize, per_row: usize) -> PyResult<()> {
        if rows.checked_mul(per_row) == Some(elements) {
            Ok(())
        } else {
            Err(error(format!("{what} has {elements} elements, expected {rows} x {per_row}")))
        }
    }

    /// `gather` and `exact`: checks `x` (`rows x c` of `dtype`) and `out`
    /// (`rows` rows of `which`'s vector, float32), then reads without the GIL.
    fn read(
        &self,
        which: Read,
        x: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        dtype: &str,
        rows: usize,
    ) -> PyResult<()> {
        let dtype = Dtype::parse(dtype)?;
        let (xb, ob) = in_out(x, "x", out, "out")?;
        Self::check("x", dtype.count(&xb)?, rows, self.c)?;
        let o = f32_mut(&ob)?;
        Self::check("out", o.len(), rows, which.len(self))?;
        let input = elems(&xb, dtype)?;
        x.py().detach(|| match input {
            Elems::F32(v) => read_rows(self, which, v, rows, o),
            Elems::Bf16(v) => read_rows(self, which, v, rows, o),
            Elems::F16(v) => read_rows(self, which, v, rows, o),
        });
        Ok(())
    }
}

/// Which vector of a chunk [`read_rows`] reads: the quantized one (`gather`)
/// or the exact one of the 1-D parameters (`exact`).
#[derive(Clone, Copy)]
enum Read {
    Quantized,
    Exact,
}

impl Read {
    /// Elements of one row of this vector.
    fn len(self, lay: &ChunkLayout) -> usize {
        match self {
            Read::Quantized => lay.cq,
            Read::Exact => lay.exact_len,
        }
    }
}

fn read_rows<T: Element>(lay: &ChunkLayout, which: Read, x: &[T], rows: usize, out: &mut [f32]) {
    let n = which.len(lay);
    for (r, row) in out.chunks_exact_mut(n.max(1)).take(rows).enumerate() {
        match which {
            Read::Quantized => lay.fill_row(x, r, row),
            Read::Exact => {
                for s in lay.segs.iter().filter(|s| s.exact) {
                    T::to_f32_slice(&x[r * lay.c + s.at..][..s.n], &mut row[s.to..s.to + s.n]);
                }
            }
        }
    }
}

fn scatter_rows<T: Element>(lay: &ChunkLayout, part: &[f32], exact: &[f32], rows: usize, out: &mut [T]) {
    for r in 0..rows {
        for s in &lay.segs {
            let dst = &mut out[r * lay.c + s.at..r * lay.c + s.at + s.n];
            let src = if s.exact { &exact[r * lay.exact_len + s.to..] } else { &part[r * lay.cq + s.to..] };
            T::from_f32_slice(&src[..s.n], dst);
        }
    }
}

#[pymethods]
impl ChunkLayout {
    #[new]
    #[pyo3(signature = (segments, *, align, exclude_1d = true))]
    fn new(segments: Vec<(usize, bool)>, align: usize, exclude_1d: bool) -> PyResult<Self> {
        if align == 0 {
            return Err(error("ChunkLayout: align must be at least 1"));
        }
        let (mut at, mut cq, mut exact_len) = (0usize, 0usize, 0usize);
        let mut segs = Vec::with_capacity(segments.len());
        let overflow = || error("ChunkLayout: the segments' sizes overflow");
        for (n, one_d) in segments {
            let exact = one_d && exclude_1d;
            if n > 0 {
                if exact {
                    segs.push(Seg { at, n, exact, to: exact_len });
                    exact_len = exact_len.checked_add(n).ok_or_else(overflow)?;
                } else {
                    segs.push(Seg { at, n, exact, to: cq });
                    cq = n
                        .div_ceil(align)
                        .checked_mul(align)
                        .and_then(|k| cq.checked_add(k))
                        .ok_or_else(overflow)?;
                }
            }
            at = at.checked_add(n).ok_or_else(overflow)?;
        }
        Ok(Self { segs, c: at, cq, exact_len })
    }

    /// Elements of the chunk (the segments' sum).
    #[getter]
    fn c(&self) -> usize {
        self.c
    }

    /// Elements of the quantized vector (parameters from `align` boundaries).
    #[getter]
    fn cq(&self) -> usize {
        self.cq
    }

    /// Elements of the exact vector (the 1-D parameters).
    #[getter]
    fn exact_len(&self) -> usize {
        self.exact_len
    }

    /// gather(x, out, *, dtype, rows=1) -> None
    ///
    /// The quantized vectors of `rows` chunks: `x` holds `rows x c` elements of
    /// `dtype`, `out` receives `rows x cq` float32 (zeros between parameters).
    #[pyo3(signature = (x, out, *, dtype, rows = 1))]
    fn gather(&self, x: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>, dtype: &str, rows: usize) -> PyResult<()> {
        self.read(Read::Quantized, x, out, dtype, rows)
    }

    /// exact(x, out, *, dtype, rows=1) -> None
    ///
    /// The exact vectors (the 1-D parameters) of `rows` chunks: `x` holds
    /// `rows x c` elements of `dtype`, `out` receives `rows x exact_len` float32.
    #[pyo3(signature = (x, out, *, dtype, rows = 1))]
    fn exact(&self, x: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>, dtype: &str, rows: usize) -> PyResult<()> {
        self.read(Read::Exact, x, out, dtype, rows)
    }

    /// scatter(part, out, *, dtype, exact=None, rows=1) -> None
    ///
    /// The inverse: `rows` chunks (`out`, `rows x c` elements of `dtype`) from
    /// their quantized vectors (`part`, `rows x cq` float32) and exact vectors
    /// (`exact`, `rows x exact_len` float32; needed when `exact_len > 0`).
    /// Every element of `out` is written.
    #[pyo3(signature = (part, out, *, dtype, exact = None, rows = 1))]
    fn scatter(
        &self,
        py: Python<'_>,
        part: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        dtype: &str,
        exact: Option<&Bound<'_, PyAny>>,
        rows: usize,
    ) -> PyResult<()> {
        let dtype = Dtype::parse(dtype)?;
        let (pb, ob) = (Buf::get(part, "part", false)?, Buf::get(out, "out", true)?);
        let eb = exact.map(|e| Buf::get(e, "exact", false)).transpose()?;
        let mut all = vec![&pb, &ob];
        all.extend(eb.as_ref());
        check_disjoint(&all)?;
        let p = f32_ref(&pb)?;
        Self::check("part", p.len(), rows, self.cq)?;
        let e: &[f32] = match &eb {
            Some(b) => f32_ref(b)?,
            None if self.exact_len == 0 => &[],
            None => return Err(error("scatter: the layout has 1-D parameters, so `exact` is needed")),
        };
        Self::check("exact", e.len(), rows, self.exact_len)?;
        Self::check("out", dtype.count(&ob)?, rows, self.c)?;
        let o = elems_mut(&ob, dtype)?;
        py.detach(|| match o {
            ElemsMut::F32(v) => scatter_rows(self, p, e, rows, v),
            ElemsMut::Bf16(v) => scatter_rows(self, p, e, rows, v),
            ElemsMut::F16(v) => scatter_rows(self, p, e, rows, v),
        });
        Ok(())
    }
}

/// `rows` FSDP2 chunks read through a [`ChunkLayout`] as qgZ's gradient of
/// `rows x cq` elements: shard `p` is chunk `p`'s quantized vector.
pub(crate) struct LaidOut<'a> {
    pub(crate) x: Elems<'a>,
    pub(crate) layout: &'a ChunkLayout,
    pub(crate) rows: usize,
}

impl PartSource for LaidOut<'_> {
    fn len(&self) -> usize {
        self.rows * self.layout.cq
    }

    fn with_part(&self, part: usize, s: usize, f: &mut PartFn<'_>) -> Result<(), CommError> {
        let lay = self.layout;
        if s != lay.cq || part >= self.rows {
            return Err(CommError::Mismatch(format!(
                "a chunk layout of {} rows x {} elements asked for shard {part} of {s}",
                self.rows, lay.cq
            )));
        }
        if let (Elems::F32(v), true) = (&self.x, lay.is_identity()) {
            return f(&v[part * lay.c..(part + 1) * lay.c]);
        }
        let mut row = vec![0f32; s];
        match &self.x {
            Elems::F32(v) => lay.fill_row(v, part, &mut row),
            Elems::Bf16(v) => lay.fill_row(v, part, &mut row),
            Elems::F16(v) => lay.fill_row(v, part, &mut row),
        }
        f(&row)
    }
}
