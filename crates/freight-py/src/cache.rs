//! The cache engine's binding (`freight_cache`), wrapped by `freight.CacheEngine`.
//!
//! Python checks the KV tensor (dtype, shape, device) and passes its memory as a dict
//! of (kind, address, length, device) and the layout; `store` and `retrieve` copy with the GIL
//! released. A store sender or receiver given to the engine is handed over: the engine
//! owns it from then on, and keeps its Python object (and what that keeps) alive.

use std::sync::{Arc, Mutex};

use freight_cache::{CacheConfig, CacheEngine, KvLayout, KvMemory, KvShape, Place};
use freight_core::{Error, MemKind, Result};
use numpy::PyReadonlyArray1;
use pyo3::prelude::*;

use crate::agent::PyAgent;
use crate::descs::parse_kind;
use crate::errors::{invalid, OrRaise};
use crate::interrupt;
use crate::stream::{PyStoreReceiver, PyStoreSender};

/// Native cache engine (use `freight.CacheEngine`).
#[pyclass(frozen, name = "CacheEngine", module = "freight._native")]
pub struct PyCacheEngine {
    inner: Mutex<Option<CacheEngine>>,
    config: CacheConfig,
    _sink: Option<Py<PyStoreSender>>,
    _source: Option<Py<PyStoreReceiver>>,
}

fn lock(m: &Mutex<Option<CacheEngine>>) -> std::sync::MutexGuard<'_, Option<CacheEngine>> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn tokens_arg(tokens: &PyReadonlyArray1<'_, u32>) -> PyResult<Vec<u32>> {
    Ok(tokens.as_slice().map_err(|_| invalid("the tokens must be a contiguous array"))?.to_vec())
}

/// The caller's KV memory as `freight.CacheEngine` describes it, in a dict: where it
/// lies (kind, addr, len, dev) and its layout: `kv_tokens` for contiguous memory, or
/// `block_size`, `num_blocks` and `block_table` for paged memory.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct KvArgs<'py> {
    kind: String,
    addr: u64,
    len: u64,
    dev: u64,
    #[pyo3(default)]
    kv_tokens: Option<u64>,
    #[pyo3(default)]
    block_size: Option<u64>,
    #[pyo3(default)]
    num_blocks: Option<u64>,
    #[pyo3(default)]
    block_table: Option<PyReadonlyArray1<'py, u64>>,
}

impl KvArgs<'_> {
    fn memory(&self) -> PyResult<KvMemory> {
        let place = match parse_kind(&self.kind)? {
            MemKind::Dram => Place::host(self.addr),
            MemKind::Vram => Place::gpu(self.addr, self.dev),
            other => return Err(invalid(format!("KV memory must be host or GPU memory, got {}", other.as_str()))),
        };
        let layout = match (self.kv_tokens, self.block_size, self.num_blocks, &self.block_table) {
            (Some(tokens), None, None, None) => KvLayout::Contiguous { tokens },
            (None, Some(block_size), Some(num_blocks), Some(table)) => KvLayout::Paged {
                block_size,
                num_blocks,
                block_table: table
                    .as_slice()
                    .map_err(|_| invalid("the block table must be a contiguous array"))?
                    .to_vec(),
            },
            _ => {
                return Err(invalid("give the KV memory's token count, or its block size, block count and block table"))
            }
        };
        Ok(KvMemory { place, len: self.len, layout })
    }
}

impl PyCacheEngine {
    /// Runs `f` on the engine with the GIL released (the lock is taken there too);
    /// Ctrl-C interrupts its waits.
    fn with<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut CacheEngine) -> Result<T> + Send) -> PyResult<T> {
        interrupt::detach(py, || match lock(&self.inner).as_mut() {
            Some(e) => f(e),
            None => Err(Error::InvalidState("the cache engine is closed".into())),
        })
    }
}

#[pymethods]
impl PyCacheEngine {
    /// An engine whose tiers are memory of `agent`, keying chunks in `namespace`;
    /// `remote_sink` / `remote_source` are handed over to it.
    #[new]
    #[pyo3(signature = (agent, layers, heads, head_dim, elem_bytes, chunk_tokens = 256, gpu = None, gpu_bytes = 0, host_bytes = 1 << 30, remote_sink = None, remote_source = None, namespace = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        agent: &Bound<'_, PyAgent>,
        layers: u64,
        heads: u64,
        head_dim: u64,
        elem_bytes: u64,
        chunk_tokens: u64,
        gpu: Option<usize>,
        gpu_bytes: u64,
        host_bytes: u64,
        remote_sink: Option<Bound<'_, PyStoreSender>>,
        remote_source: Option<Bound<'_, PyStoreReceiver>>,
        namespace: Vec<u8>,
    ) -> PyResult<Self> {
        // The engine refuses a sink with objects not committed, and would drop it: it
        // is refused here, before it is handed over, so that its owner keeps it.
        let check_sink = || match remote_sink.as_ref() {
            None => Ok(()),
            Some(s) if s.getattr("pending")?.extract::<usize>()? > 0 => Err(invalid(
                "the remote sink has objects not committed; commit them before giving it to a cache engine",
            )),
            Some(s) => s.get().check_live(py),
        };
        // Both ends must be free to hand over before anything is built.
        check_sink()?;
        if let Some(s) = &remote_source {
            s.get().check_live(py)?;
        }
        let config = CacheConfig {
            chunk_tokens,
            shape: KvShape { layers, heads, head_dim, elem_bytes },
            gpu,
            gpu_bytes,
            host_bytes,
        };
        let a = Arc::clone(&agent.get().inner);
        let cfg = config.clone();
        let mut engine = py.detach(move || CacheEngine::new(&a, cfg)).or_raise()?.with_namespace(&namespace);
        // An end taken over is not given back: the source goes first, since it is the
        // one that may refuse (a wait on another thread uses it) and then stays with its
        // owner; the sender, checked again after the build (which releases the GIL for a
        // while), can then only be lost to a close racing this call.
        check_sink()?;
        if let Some(s) = &remote_source {
            engine = engine.with_remote_source(s.get().hand_over(py)?);
        }
        if let Some(s) = &remote_sink {
            engine = engine.with_remote_sink(s.get().hand_over(py)?).or_raise()?;
        }
        Ok(PyCacheEngine {
            inner: Mutex::new(Some(engine)),
            config,
            _sink: remote_sink.map(Bound::unbind),
            _source: remote_source.map(Bound::unbind),
        })
    }

    /// Stores the KV cache of `tokens` from the KV memory `kv`; returns (chunks, new
    /// chunks, bytes copied).
    fn store(
        &self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, u32>,
        kv: KvArgs<'_>,
    ) -> PyResult<(usize, usize, u64)> {
        let tokens = tokens_arg(&tokens)?;
        let kv = kv.memory()?;
        let r = self.with(py, |e| e.store(&tokens, &kv))?;
        Ok((r.chunks, r.new_chunks, r.bytes))
    }

    /// Copies the longest stored prefix of `tokens` into the KV memory `kv`; returns
    /// its length in tokens.
    fn retrieve(&self, py: Python<'_>, tokens: PyReadonlyArray1<'_, u32>, kv: KvArgs<'_>) -> PyResult<usize> {
        let tokens = tokens_arg(&tokens)?;
        let kv = kv.memory()?;
        self.with(py, |e| e.retrieve(&tokens, &kv))
    }

    /// Tokens of the longest stored prefix of `tokens` that `retrieve` would copy (its
    /// chunks count as used).
    fn lookup(&self, py: Python<'_>, tokens: PyReadonlyArray1<'_, u32>) -> PyResult<usize> {
        let tokens = tokens_arg(&tokens)?;
        self.with(py, |e| Ok(e.lookup(&tokens)))
    }

    /// Chunks held in each local tier: [(name, chunks)].
    fn occupancy(&self, py: Python<'_>) -> PyResult<Vec<(String, usize)>> {
        self.with(py, |e| Ok(e.occupancy().into_iter().map(|(n, c)| (n.to_string(), c)).collect()))
    }

    /// Commits what a remote sink still has queued, ends its stream and frees the
    /// tiers. Harmless when called again.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        interrupt::detach(py, || match lock(&self.inner).take() {
            Some(e) => e.close(),
            None => Ok(()),
        })
    }

    /// False once closed.
    #[getter]
    fn live(&self, py: Python<'_>) -> bool {
        py.detach(|| lock(&self.inner).is_some())
    }

    #[getter]
    fn chunk_tokens(&self) -> u64 {
        self.config.chunk_tokens
    }

    /// Bytes of a full chunk.
    #[getter]
    fn chunk_bytes(&self) -> u64 {
        self.config.shape.chunk_bytes(self.config.chunk_tokens)
    }

    #[getter]
    fn gpu(&self) -> Option<usize> {
        self.config.gpu
    }

    #[getter]
    fn gpu_bytes(&self) -> u64 {
        self.config.gpu_bytes
    }

    #[getter]
    fn host_bytes(&self) -> u64 {
        self.config.host_bytes
    }
}

impl Drop for PyCacheEngine {
    fn drop(&mut self) {
        // The engine goes first (its store ends talk to their peers), then the Python
        // objects that keep their memory alive.
        if let Some(e) = lock(&self.inner).take() {
            Python::attach(|py| py.detach(move || drop(e)));
        }
    }
}
