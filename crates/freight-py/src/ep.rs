//! Expert parallelism: the rank server, joined groups, and one rank's dispatch/combine
//! buffer. Tensors stay in Python (python/freight/ep.py checks and allocates them); these
//! bindings take device addresses and the caller's CUDA stream.

use std::sync::Arc;

use freight_ep::rendezvous::{EtcdGroup, Group, RankServer, ServerGroup};
use freight_ep::{Backend, Buffer, CombineArgs, Config, DispatchInputs, DispatchOutputs, Options};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{invalid, to_py_err, OrRaise};
use crate::interrupt;
use crate::util::seconds;

fn socket_address(address: &str) -> PyResult<std::net::SocketAddr> {
    use std::net::ToSocketAddrs;
    address
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| invalid(format!("'{address}' is not a host:port address")))
}

/// A rank server for `world` ranks, listening on `address` ("host:port", port 0 for any
/// free one) until closed or dropped; with `token`, only ranks that present it may join.
/// Ranks join with `Group.join`.
#[pyclass(name = "EpRankServer", module = "freight.ep")]
pub struct PyRankServer {
    inner: Option<RankServer>,
    address: String,
}

#[pymethods]
impl PyRankServer {
    #[new]
    #[pyo3(signature = (address, world, token = None))]
    fn new(py: Python<'_>, address: &str, world: usize, token: Option<String>) -> PyResult<Self> {
        let at = socket_address(address)?;
        let server = py.detach(|| RankServer::start(at, world, token.as_deref())).or_raise()?;
        let address = server.addr().to_string();
        Ok(PyRankServer { inner: Some(server), address })
    }

    /// Where it listens ("host:port", with the real port).
    #[getter]
    fn address(&self) -> String {
        self.address.clone()
    }

    /// Stops serving.
    fn close(&mut self, py: Python<'_>) {
        let server = self.inner.take();
        py.detach(move || drop(server));
    }
}

/// A joined group of ranks (see `freight.ep.Group`).
#[pyclass(frozen, name = "EpGroup", module = "freight.ep")]
pub struct PyGroup {
    pub(crate) inner: Arc<dyn Group>,
}

#[pymethods]
impl PyGroup {
    /// Joins through the rank server at `address`, retrying until `timeout` seconds, with
    /// the server's `token` where it has one.
    #[staticmethod]
    #[pyo3(signature = (address, rank, world, timeout, token = None))]
    fn join_server(
        py: Python<'_>,
        address: &str,
        rank: usize,
        world: usize,
        timeout: f64,
        token: Option<String>,
    ) -> PyResult<Self> {
        let at = socket_address(address)?;
        let timeout = seconds(timeout, "timeout")?;
        let group = interrupt::detach(py, || ServerGroup::join(at, rank, world, timeout, token.as_deref()))?;
        Ok(PyGroup { inner: Arc::new(group) })
    }

    /// Joins through etcd at `endpoints` under the name `group`.
    #[staticmethod]
    fn join_etcd(
        py: Python<'_>,
        endpoints: Vec<String>,
        group: &str,
        rank: usize,
        world: usize,
        timeout: f64,
    ) -> PyResult<Self> {
        let timeout = seconds(timeout, "timeout")?;
        let joined = interrupt::detach(py, || EtcdGroup::join(&endpoints, group, rank, world, timeout))?;
        Ok(PyGroup { inner: Arc::new(joined) })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    #[getter]
    fn world(&self) -> usize {
        self.inner.world()
    }

    /// Every rank's `blob`, in rank order.
    fn all_gather<'py>(&self, py: Python<'py>, blob: Vec<u8>, timeout: f64) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let timeout = seconds(timeout, "timeout")?;
        let group = self.inner.clone();
        let blobs = interrupt::detach(py, move || group.all_gather(&blob, timeout))?;
        Ok(blobs.iter().map(|b| PyBytes::new(py, b)).collect())
    }

    fn barrier(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let timeout = seconds(timeout, "timeout")?;
        let group = self.inner.clone();
        interrupt::detach(py, move || group.barrier(timeout))
    }

    /// `(rank, reason)` of the first rank known dead, or None.
    fn dead(&self) -> Option<(usize, String)> {
        self.inner.dead()
    }

    fn leave(&self, py: Python<'_>) -> PyResult<()> {
        let group = self.inner.clone();
        py.detach(move || group.leave()).or_raise()
    }
}

/// One rank's buffer on GPU `device` (see `freight.ep.Buffer`). Every method takes the
/// CUDA stream to queue on (as an integer handle) and device addresses that the Python
/// layer has checked against the sizes the buffer was made for.
#[pyclass(frozen, name = "EpBuffer", module = "freight.ep")]
pub struct PyBuffer {
    inner: Arc<Buffer>,
}

fn stream(handle: usize) -> cudarc::driver::sys::CUstream {
    handle as cudarc::driver::sys::CUstream
}

fn token_count(tokens: usize) -> PyResult<i32> {
    i32::try_from(tokens).map_err(|_| invalid(format!("{tokens} tokens do not fit a 32-bit count")))
}

/// A dispatch's inputs as Python passes them: `(x, topk_idx, topk_weights, tokens, slot,
/// fp8)`.
type InputsTuple = (u64, u64, u64, usize, u64, bool);

/// A dispatch's outputs as Python passes them: `(recv_x, recv_scales, recv_expert,
/// recv_weight, row_pairs, row_source, received)` (0 for those not wanted).
type OutputsTuple = (u64, u64, u64, u64, u64, u64, u64);

fn dispatch_inputs(
    b: &Buffer,
    (x, topk_idx, topk_weights, tokens, slot, fp8): InputsTuple,
) -> PyResult<DispatchInputs> {
    let row_bytes = b.row_bytes(fp8).0;
    Ok(DispatchInputs { x, row_bytes, topk_idx, topk_weights, tokens: token_count(tokens)?, slot })
}

fn dispatch_outputs(b: &Buffer, fp8: bool, expert_stride: u64, outputs: OutputsTuple) -> DispatchOutputs {
    let (recv_x, recv_tail, recv_expert, recv_weight, row_pairs, row_source, received) = outputs;
    let (row_bytes, head_bytes) = b.row_bytes(fp8);
    DispatchOutputs {
        recv_x,
        expert_stride,
        row_bytes,
        head_bytes,
        recv_tail,
        recv_expert,
        recv_weight,
        row_pairs,
        row_source,
        received,
    }
}

#[pymethods]
impl PyBuffer {
    #[new]
    #[pyo3(signature = (group, device, max_tokens, hidden, topk, experts_per_rank, timeout, backend = "ipc", listen = "127.0.0.1:0"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        group: &PyGroup,
        device: usize,
        max_tokens: usize,
        hidden: usize,
        topk: usize,
        experts_per_rank: usize,
        timeout: f64,
        backend: &str,
        listen: &str,
    ) -> PyResult<Self> {
        let options = Options {
            backend: Backend::parse(backend).or_raise()?,
            listen: listen.into(),
            timeout: seconds(timeout, "timeout")?,
        };
        let config = Config { ranks: 0, rank: 0, max_tokens, hidden, topk, local_experts: experts_per_rank };
        let group = group.inner.clone();
        let buffer = interrupt::detach(py, move || Buffer::new(group, device, config, &options))?;
        Ok(PyBuffer { inner: Arc::new(buffer) })
    }

    /// Lays out `topk_idx` into `slot`, `send_count` and `expert_count`; waits.
    #[allow(clippy::too_many_arguments)]
    fn layout(
        &self,
        py: Python<'_>,
        stream_handle: usize,
        topk_idx: u64,
        tokens: usize,
        slot: u64,
        send_count: u64,
        expert_count: u64,
    ) -> PyResult<()> {
        let b = self.inner.clone();
        // SAFETY: the Python layer allocated every tensor on this buffer's GPU with the
        // sizes the call implies, and passes the current stream of that GPU.
        py.detach(move || unsafe { b.layout(stream(stream_handle), topk_idx, tokens, slot, send_count, expert_count) })
            .or_raise()
    }

    /// Sends the tokens (`inputs`: `(x, topk_idx, topk_weights, tokens, slot)`) and
    /// waits for everyone's; returns (rows per source rank, pairs per local expert).
    fn dispatch_begin(
        &self,
        py: Python<'_>,
        stream_handle: usize,
        inputs: InputsTuple,
    ) -> PyResult<(Vec<usize>, Vec<usize>)> {
        let b = self.inner.clone();
        let inputs = dispatch_inputs(&b, inputs)?;
        // SAFETY: as for `layout`.
        let counts = py.detach(move || unsafe { b.dispatch_begin(stream(stream_handle), &inputs) }).or_raise()?;
        Ok((counts.per_source_rank, counts.per_local_expert))
    }

    /// Fills `outputs` (`(recv_x, recv_scales, recv_expert, recv_weight, row_pairs,
    /// row_source, received)`), sized by `dispatch_begin`'s counts. Returns the
    /// exception for bad routing (the dispatch completed without the bad choices), or
    /// None: the caller raises it with the outputs attached.
    fn dispatch_finish(
        &self,
        py: Python<'_>,
        stream_handle: usize,
        outputs: OutputsTuple,
        fp8: bool,
    ) -> PyResult<Option<Py<pyo3::exceptions::PyBaseException>>> {
        let b = self.inner.clone();
        let outputs = dispatch_outputs(&b, fp8, 0, outputs);
        // SAFETY: as for `layout`.
        let routing = py.detach(move || unsafe { b.dispatch_finish(stream(stream_handle), &outputs) }).or_raise()?;
        Ok(routing.map(|e| to_py_err(e).into_value(py)))
    }

    /// Gives up a dispatch begun and not finished: the buffer is unusable from here on,
    /// and later calls say so (a no-op when no dispatch is half done).
    fn abandon(&self) {
        self.inner.abandon();
    }

    /// A whole low-latency dispatch of `inputs` (as for `dispatch_begin`) into `outputs`
    /// (as for `dispatch_finish`) sized for the most it can deliver (`most_received`
    /// rows per local expert), and the rows per local expert into `counts`; does not
    /// wait.
    fn dispatch_low_latency(
        &self,
        py: Python<'_>,
        stream_handle: usize,
        inputs: InputsTuple,
        outputs: OutputsTuple,
        counts: u64,
    ) -> PyResult<()> {
        let b = self.inner.clone();
        let fp8 = inputs.5;
        let inputs = dispatch_inputs(&b, inputs)?;
        let outputs = dispatch_outputs(&b, fp8, b.most_received() as u64, outputs);
        // SAFETY: as for `layout`.
        py.detach(move || unsafe { b.dispatch_low_latency(stream(stream_handle), &inputs, &outputs, counts) })
            .or_raise()
    }

    /// Whether dispatch can send fp8 (hidden a multiple of 512).
    #[getter]
    fn fp8_available(&self) -> bool {
        self.inner.fp8_available()
    }

    /// Most tokens one dispatch delivers to a rank (ranks x max_tokens).
    #[getter]
    fn most_received(&self) -> usize {
        self.inner.most_received()
    }

    /// Queues a combine (does not wait).
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &self,
        py: Python<'_>,
        stream_handle: usize,
        expert_out: u64,
        weights: u64,
        row_pairs: u64,
        row_source: u64,
        received: u64,
        most_rows: usize,
        slot: u64,
        tokens: usize,
        out: u64,
    ) -> PyResult<()> {
        let b = self.inner.clone();
        let tokens = token_count(tokens)?;
        let args = CombineArgs { expert_out, weights, row_pairs, row_source, received, most_rows, slot, tokens, out };
        // SAFETY: as for `layout`.
        py.detach(move || unsafe { b.combine(stream(stream_handle), &args) }).or_raise()
    }

    /// Waits for the stream and raises what the kernels met (bad routing of a low-latency
    /// dispatch included).
    fn synchronize(&self, py: Python<'_>, stream_handle: usize) -> PyResult<()> {
        let b = self.inner.clone();
        // SAFETY: the current stream of the buffer's GPU.
        py.detach(move || unsafe { b.synchronize(stream(stream_handle)) }).or_raise()
    }

    /// Raises the error a kernel recorded, if any (does not wait).
    fn check(&self) -> PyResult<()> {
        self.inner.check().or_raise()
    }
}

/// Compiles the expert-parallel kernels for `arch` ("sm_90") with NVRTC; returns the
/// cubin's size. Needs no GPU.
#[pyfunction]
pub fn compile_ep_kernels(py: Python<'_>, arch: &str) -> PyResult<usize> {
    py.detach(|| freight_ep::kernels::compile(arch)).map(|c| c.len()).or_raise()
}
