//! Descriptor lists and prepared lists.

use freight_core::{Desc, DescList, MemKind, PreparedList, RemoteList};
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors::{invalid, OrRaise};

/// Calls `f` for every `(addr, length, device)` triple of `obj`: an Nx3 numpy array of
/// uint64 or int64 (read in Rust, row by row, any strides), or an iterable of 3-tuples.
pub(crate) fn for_each_triple(
    obj: &Bound<'_, PyAny>,
    mut f: impl FnMut(u64, u64, u64) -> freight_core::Result<()>,
) -> PyResult<()> {
    if let Ok(a) = obj.cast::<PyArray2<u64>>() {
        check_nx3(a.shape())?;
        let ro = a.try_readonly().map_err(|e| invalid(e.to_string()))?;
        if let (true, Ok(flat)) = (a.is_c_contiguous(), ro.as_slice()) {
            // C-contiguous (the usual case): a plain walk over the rows.
            for row in flat.chunks_exact(3) {
                f(row[0], row[1], row[2]).or_raise()?;
            }
            return Ok(());
        }
        for row in ro.as_array().rows() {
            f(row[0], row[1], row[2]).or_raise()?;
        }
        return Ok(());
    }
    if let Ok(a) = obj.cast::<PyArray2<i64>>() {
        check_nx3(a.shape())?;
        let ro = a.try_readonly().map_err(|e| invalid(e.to_string()))?;
        for (i, row) in ro.as_array().rows().into_iter().enumerate() {
            if let Some((column, v)) = ["address", "length", "device"].into_iter().zip(row).find(|(_, v)| **v < 0) {
                return Err(invalid(format!(
                    "descriptor row {i} has a negative {column} ({v}); addresses, lengths and devices are >= 0"
                )));
            }
            f(row[0] as u64, row[1] as u64, row[2] as u64).or_raise()?;
        }
        return Ok(());
    }
    if let Ok(a) = obj.cast::<PyUntypedArray>() {
        return Err(invalid(format!(
            "a descriptor array must be Nx3 of uint64 or int64 (address, length, device); got shape {:?} and dtype {}",
            a.shape(),
            a.dtype()
        )));
    }
    let iter = obj
        .try_iter()
        .map_err(|_| invalid(format!("expected (addr, length, device) tuples, got {}", type_name(obj))))?;
    for (i, item) in iter.enumerate() {
        let item = item?;
        let triple =
            item.cast::<PyTuple>().ok().and_then(|t| t.extract::<(u64, u64, u64)>().ok()).ok_or_else(|| {
                invalid(format!(
                    "descriptor {i} must be a tuple (addr, length, device) of non-negative ints, got {}",
                    item.repr().map(|r| r.to_string()).unwrap_or_else(|_| type_name(&item))
                ))
            })?;
        f(triple.0, triple.1, triple.2).or_raise()?;
    }
    Ok(())
}

fn check_nx3(shape: &[usize]) -> PyResult<()> {
    if shape.len() != 2 || shape[1] != 3 {
        return Err(invalid(format!("a descriptor array must have shape (N, 3); got {shape:?}")));
    }
    Ok(())
}

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

pub(crate) fn parse_kind(kind: &str) -> PyResult<MemKind> {
    MemKind::parse(kind).or_raise()
}

/// The canonical name ("DRAM", "VRAM" or "FILE") of a memory kind or one of its aliases
/// ("host", "cpu", "gpu", "cuda"; any case); InvalidArgumentError for anything else.
#[pyfunction]
pub(crate) fn normalize_kind(kind: &str) -> PyResult<&'static str> {
    Ok(parse_kind(kind)?.as_str())
}

/// Index selections into a list of `len` descriptors: a 1-D numpy array of uint64,
/// uint32, int64 or int32 (the Python layer normalises lists and other integer dtypes),
/// copied so that the GIL can be released afterwards; None for no selection, and for
/// every index in order (np.arange(len)), which selects the same without a copy. A
/// negative index is an error naming it.
pub(crate) fn indices(obj: Option<&Bound<'_, PyAny>>, len: u64) -> PyResult<Option<Vec<u64>>> {
    let Some(obj) = obj else { return Ok(None) };
    if obj.is_none() {
        return Ok(None);
    }
    /// `index(i)`: the index as u64, or None where it is negative.
    fn read<T: Copy + numpy::Element>(
        a: &Bound<'_, PyArray1<T>>,
        len: u64,
        index: impl Fn(T) -> Option<u64>,
        bits: impl Fn(T) -> u64,
        shown: impl Fn(T) -> String,
    ) -> PyResult<Option<Vec<u64>>> {
        let ro = a.try_readonly().map_err(|e| invalid(e.to_string()))?;
        let owned;
        let values: &[T] = match ro.as_slice() {
            Ok(s) => s,
            Err(_) => {
                owned = ro.as_array().iter().copied().collect::<Vec<T>>();
                &owned
            }
        };
        if values.len() as u64 == len && in_order(values, &bits) {
            return Ok(None);
        }
        values
            .iter()
            .map(|&i| index(i).ok_or_else(|| invalid(format!("indices must be non-negative, got {}", shown(i)))))
            .collect::<PyResult<Vec<u64>>>()
            .map(Some)
    }
    /// Whether `values` are 0, 1, 2, ... (as bits: a negative value never matches). Block
    /// by block without an early exit inside a block, which the compiler vectorizes: the
    /// check of 65536 indices costs microseconds, not one branch per index.
    fn in_order<T: Copy>(values: &[T], bits: impl Fn(T) -> u64) -> bool {
        let mut k = 0u64;
        values.chunks(512).all(|block| {
            let mut diff = 0u64;
            for &v in block {
                diff |= bits(v) ^ k;
                k += 1;
            }
            diff == 0
        })
    }
    if let Ok(a) = obj.cast::<PyArray1<u64>>() {
        return read(a, len, Some, |i| i, |i| i.to_string());
    }
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        return read(a, len, |i| u64::try_from(i).ok(), |i| i as u64, |i| i.to_string());
    }
    if let Ok(a) = obj.cast::<PyArray1<u32>>() {
        return read(a, len, |i| Some(u64::from(i)), u64::from, |i| i.to_string());
    }
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        return read(a, len, |i| u64::try_from(i).ok(), |i| i as u64, |i| i.to_string());
    }
    Err(invalid(format!("indices must be a 1-D integer array, got {}", type_name(obj))))
}

/// Raw descriptor list (use `freight.DescList`, which builds one from arrays, tensors,
/// tuples or Nx3 arrays).
#[pyclass(name = "DescList", module = "freight._native")]
pub struct PyDescList {
    pub(crate) inner: DescList,
}

#[pymethods]
impl PyDescList {
    /// DescList(kind="DRAM"): an empty list of descriptors of one memory kind.
    #[new]
    #[pyo3(signature = (kind = "DRAM"))]
    fn new(kind: &str) -> PyResult<Self> {
        Ok(PyDescList { inner: DescList::new(parse_kind(kind)?) })
    }

    /// Appends one descriptor.
    #[pyo3(signature = (addr, length, device = 0))]
    fn push(&mut self, addr: u64, length: u64, device: u64) -> PyResult<()> {
        self.inner.push(Desc { addr, len: length, dev: device }).or_raise()
    }

    /// Appends `count` descriptors of `length` bytes, the i-th at `addr + i * stride`
    /// (stored as one run, never materialised).
    fn push_strided(&mut self, addr: u64, length: u64, device: u64, stride: u64, count: u64) -> PyResult<()> {
        self.inner.push_strided(addr, length, device, stride, count).or_raise()
    }

    /// Appends (addr, length, device) triples from a list of tuples or an Nx3 uint64/int64
    /// array. All or nothing: on error the list is unchanged.
    fn extend(&mut self, triples: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut list = self.inner.clone();
        // Regular stretches (block i at base + i*stride) become strided runs.
        if let Ok(a) = triples.cast::<PyArray2<u64>>() {
            check_nx3(a.shape())?;
            let ro = a.try_readonly().map_err(|e| invalid(e.to_string()))?;
            if let (true, Ok(flat)) = (a.is_c_contiguous(), ro.as_slice()) {
                // The usual case, read in place.
                let rows = flat.chunks_exact(3).map(|r| Desc { addr: r[0], len: r[1], dev: r[2] });
                list.extend_merging(rows).or_raise()?;
                self.inner = list;
                return Ok(());
            }
        }
        let mut descs = Vec::new();
        for_each_triple(triples, |addr, len, dev| {
            descs.push(Desc { addr, len, dev });
            Ok(())
        })?;
        list.extend_merging(descs).or_raise()?;
        self.inner = list;
        Ok(())
    }

    /// Appends every run of `other` (strided runs stay runs). All or nothing.
    fn extend_runs(&mut self, other: PyRef<'_, PyDescList>) -> PyResult<()> {
        if other.inner.kind() != self.inner.kind() {
            return Err(invalid(format!(
                "cannot append {} descriptors to a {} list",
                other.inner.kind(),
                self.inner.kind()
            )));
        }
        let mut list = self.inner.clone();
        for r in other.inner.runs() {
            list.push_strided(r.addr, r.len, r.dev, r.stride, r.count).or_raise()?;
        }
        self.inner = list;
        Ok(())
    }

    /// An independent copy.
    fn copy(&self) -> PyDescList {
        PyDescList { inner: self.inner.clone() }
    }

    /// Memory kind of every descriptor: "DRAM", "VRAM" or "FILE".
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind().as_str()
    }

    /// Total bytes over all descriptors.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.total_bytes()
    }

    /// Number of runs (a strided family counts once).
    #[getter]
    fn runs(&self) -> usize {
        self.inner.runs().len()
    }

    /// Descriptor `i` as (addr, length, device).
    fn get(&self, i: u64) -> PyResult<(u64, u64, u64)> {
        let d = self
            .inner
            .get(i)
            .ok_or_else(|| invalid(format!("index {i} out of range for a list of {} descriptors", self.inner.len())))?;
        Ok((d.addr, d.len, d.dev))
    }

    /// Python caps lengths at `sys.maxsize`; a strided run counts up to 2**64 - 1.
    fn __len__(&self) -> PyResult<usize> {
        let n = self.inner.len();
        match isize::try_from(n) {
            Ok(_) => Ok(n as usize),
            Err(_) => Err(PyOverflowError::new_err(format!(
                "the list has {n} descriptors, more than len() can count (sys.maxsize); its runs and nbytes still do"
            ))),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<freight._native.DescList {} descriptors ({} runs), {} bytes of {}>",
            self.inner.len(),
            self.inner.runs().len(),
            self.inner.total_bytes(),
            self.inner.kind()
        )
    }
}

/// A descriptor list checked against this agent's registered memory (from
/// `Agent.prepare_local`). Reusable: build any number of requests from it.
#[pyclass(frozen, name = "PreparedLocal", module = "freight")]
pub struct PyPreparedLocal {
    pub(crate) inner: PreparedList,
    pub(crate) agent_id: u64,
}

#[pymethods]
impl PyPreparedLocal {
    /// Memory kind of the descriptors.
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind().as_str()
    }
    /// Total bytes over all descriptors.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.total_bytes()
    }
    /// Keys of the registered regions the list touches.
    #[getter]
    fn regions(&self) -> Vec<u64> {
        self.inner.regions().to_vec()
    }
    fn __len__(&self) -> usize {
        self.inner.len() as usize
    }
    fn __repr__(&self) -> String {
        format!("<freight.PreparedLocal {} descriptors, {} bytes>", self.inner.len(), self.inner.total_bytes())
    }
}

/// A descriptor list checked against a peer's advertised memory (from
/// `Agent.prepare_remote`). Reusable: build any number of requests from it.
#[pyclass(frozen, name = "PreparedRemote", module = "freight")]
pub struct PyPreparedRemote {
    pub(crate) inner: RemoteList,
    pub(crate) agent_id: u64,
}

#[pymethods]
impl PyPreparedRemote {
    /// Name of the peer the list was prepared against.
    #[getter]
    fn peer(&self) -> &str {
        self.inner.peer()
    }
    /// Memory kind of the descriptors.
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.list.kind().as_str()
    }
    /// Total bytes over all descriptors.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.list.total_bytes()
    }
    fn __len__(&self) -> usize {
        self.inner.list.len() as usize
    }
    fn __repr__(&self) -> String {
        format!(
            "<freight.PreparedRemote {} descriptors, {} bytes on '{}'>",
            self.inner.list.len(),
            self.inner.list.total_bytes(),
            self.inner.peer()
        )
    }
}
