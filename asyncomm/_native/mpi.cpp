// asyncomm's compiled MPI calls: the link's small sends and its receive kept posted (for
// the compiled lane, ``small.cpp``, through the capsule ``lane_calls``), awaited quick
// operations, kept all-reduces.
//
// Built by ``asyncomm build`` against the MPI library mpi4py loaded (its header beside
// it) and loaded by the MPI link (``_backends.mpi_native``); without it the link makes
// the same calls through mpi4py. Each call here stands for several of mpi4py's, each of
// which builds Python objects (a request, a buffer spec, a status read field by field):
// measured on 2 ranks, an 8-byte channel ping-pong 5.2 -> 4.7 µs a leg.
//
// Handles travel as mpi4py writes them (``Comm.handle``, ``Request.fromhandle``): an
// unsigned integer, the handle's bits (MPICH: an int, sign-extended; Open MPI: a
// pointer). MPI's errors are returned (mpi4py sets MPI_ERRORS_RETURN) and raised here as
// ``Error(code, source)``; the caller makes mpi4py's exception of the code.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

PyObject* Error = nullptr;  // Error(code, source): an MPI call failed

template <class H>
H handle_bits(uint64_t bits) {
  if constexpr (std::is_pointer_v<H>) {
    return reinterpret_cast<H>(static_cast<uintptr_t>(bits));
  } else {
    return static_cast<H>(static_cast<int>(static_cast<unsigned int>(bits)));
  }
}

template <class H>
uint64_t bits_of(H handle) {
  if constexpr (std::is_pointer_v<H>) {
    return reinterpret_cast<uintptr_t>(handle);
  } else {
    return static_cast<uint64_t>(static_cast<long long>(handle));
  }
}

template <class H>
H handle_of(PyObject* value) {
  return handle_bits<H>(PyLong_AsUnsignedLongLongMask(value));
}

template <class H>
PyObject* handle_to_python(H handle) {
  return PyLong_FromUnsignedLongLong(bits_of(handle));
}

// Send ``len`` bytes to ``dst`` on ``tag`` and test it once: 0 done, else MPI's error code;
// a send still in flight leaves its request's handle in ``pending`` (else 0). ``isend``'s,
// and the lane's (``LaneCalls``).
int lane_send(uint64_t comm, const char* buf, Py_ssize_t len, int dst, int tag,
              uint64_t* pending) {
  *pending = 0;
  if (len > INT32_MAX) return MPI_ERR_COUNT;
  MPI_Request request;
  int code = MPI_Isend(buf, static_cast<int>(len), MPI_BYTE, dst, tag,
                       handle_bits<MPI_Comm>(comm), &request);
  int done = 0;
  if (code == MPI_SUCCESS) code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
  if (code == MPI_SUCCESS && !done) *pending = bits_of(request);
  return code;
}

PyObject* fail(int code, int source) {
  PyObject* args = Py_BuildValue("(ii)", code, source);
  if (args != nullptr) {
    PyErr_SetObject(Error, args);
    Py_DECREF(args);
  }
  return nullptr;
}

bool int_arg(PyObject* value, int* out) {
  long v = PyLong_AsLong(value);
  if (v == -1 && PyErr_Occurred()) return false;
  if (v < INT32_MIN || v > INT32_MAX) {
    PyErr_SetString(PyExc_OverflowError, "an MPI int out of range");
    return false;
  }
  *out = static_cast<int>(v);
  return true;
}

// isend(comm, buffer, dst, tag): send ``buffer``'s bytes; None if the send is done at
// once (small messages are), else the request's handle (the caller keeps ``buffer``
// until it is done).
PyObject* isend(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "isend(comm, buffer, dst, tag)");
    return nullptr;
  }
  uint64_t comm = PyLong_AsUnsignedLongLongMask(args[0]);
  int dst, tag;
  if (PyErr_Occurred() || !int_arg(args[2], &dst) || !int_arg(args[3], &tag)) return nullptr;
  Py_buffer view;
  if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) return nullptr;
  if (view.len > INT32_MAX) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_ValueError, "a link message beyond 2 GiB");
    return nullptr;
  }
  uint64_t pending = 0;
  int code = lane_send(comm, static_cast<const char*>(view.buf), view.len, dst, tag, &pending);
  PyBuffer_Release(&view);  // (the caller keeps the object, which MPI may still read)
  if (code != MPI_SUCCESS) return fail(code, dst);
  if (pending == 0) Py_RETURN_NONE;
  return PyLong_FromUnsignedLongLong(pending);
}

// The quick path of an awaited point-to-point operation (``MpiBackend.quick_send`` and
// ``quick_recv``): ``nbytes`` bytes at ``address`` (of a tensor the caller keeps alive),
// elements of ``datatype``, sent to, or received from, ``peer`` on ``tag``, and tested
// twice.
// None if the operation is done, else its request's handle (the caller polls it).
// ``Isend``/``Irecv`` with a test, through mpi4py, make a request object and a buffer
// spec each; here nothing is made unless the operation is still in flight.
template <bool Send>
PyObject* point(PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError,
                    Send ? "send(comm, address, nbytes, datatype, dst, tag)"
                         : "recv(comm, address, nbytes, datatype, src, tag)");
    return nullptr;
  }
  MPI_Comm comm = handle_of<MPI_Comm>(args[0]);
  void* address = PyLong_AsVoidPtr(args[1]);
  Py_ssize_t nbytes = PyLong_AsSsize_t(args[2]);
  MPI_Datatype datatype = handle_of<MPI_Datatype>(args[3]);
  int peer, tag, size = 0;
  if (PyErr_Occurred() || !int_arg(args[4], &peer) || !int_arg(args[5], &tag)) return nullptr;
  int code = MPI_Type_size(datatype, &size);
  if (code != MPI_SUCCESS) return fail(code, peer);
  if (size <= 0 || nbytes < 0 || nbytes % size != 0 || nbytes / size > INT32_MAX) {
    PyErr_SetString(PyExc_ValueError, "a quick operation's bytes are not a count of its datatype");
    return nullptr;
  }
  int count = static_cast<int>(nbytes / size);
  MPI_Request request;
  code = Send ? MPI_Isend(address, count, datatype, peer, tag, comm, &request)
                  : MPI_Irecv(address, count, datatype, peer, tag, comm, &request);
  if (code != MPI_SUCCESS) return fail(code, peer);
  int done = 0;
  for (int i = 0; i < 2 && !done; i++) {
    // (a failed test frees the request: a receive cut short, a peer gone)
    code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) return fail(code, peer);
  }
  if (done) Py_RETURN_NONE;
  return handle_to_python(request);
}

PyObject* send(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return point<true>(args, nargs);
}

PyObject* recv(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return point<false>(args, nargs);
}

// A message of ``count`` bytes from ``source`` received into ``buffer``, read by
// ``unpack(buffer, count, max_ndim, source, message_type)`` (the compiled reader): a new
// tuple (source, count, its answer, *more), or nullptr (an error set).
PyObject* read_message(PyObject* unpack, PyObject* buffer, int count, int source,
                       PyObject* max_ndim, PyObject* message_type, PyObject* const* more,
                       Py_ssize_t nmore) {
  PyObject* result = PyTuple_New(3 + nmore);
  if (result == nullptr) return nullptr;
  PyObject* source_object = PyLong_FromLong(source);
  PyTuple_SET_ITEM(result, 0, source_object);
  PyObject* count_object = PyLong_FromLong(count);
  PyTuple_SET_ITEM(result, 1, count_object);
  if (source_object == nullptr || count_object == nullptr) {
    Py_DECREF(result);
    return nullptr;
  }
  PyObject* call[5] = {buffer, count_object, max_ndim, source_object, message_type};
  PyObject* items = PyObject_Vectorcall(unpack, call, 5, nullptr);
  if (items == nullptr) {
    Py_DECREF(result);
    return nullptr;
  }
  PyTuple_SET_ITEM(result, 2, items);
  for (Py_ssize_t i = 0; i < nmore; i++) {
    Py_INCREF(more[i]);
    PyTuple_SET_ITEM(result, 3 + i, more[i]);
  }
  return result;
}

// probe(comm, tag, at_once, unpack, max_ndim, message_type): a message from any source
// on ``tag``, found by matched probe; None if there is none. One of at most ``at_once``
// bytes (sent eagerly: here whole) is received into a new bytearray and read by
// ``unpack`` (``read_message``): (source, count, items, buffer, None), ``items`` None where
// ``unpack`` left it. A larger one is left matched for the caller to receive: (source,
// count, None, None, the message's handle, for ``Message.fromhandle``). A failed receive
// raises Error(code, source).
PyObject* probe(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError,
                    "probe(comm, tag, at_once, unpack, max_ndim, message_type)");
    return nullptr;
  }
  MPI_Comm comm = handle_of<MPI_Comm>(args[0]);
  int tag, at_once;
  if (PyErr_Occurred() || !int_arg(args[1], &tag) || !int_arg(args[2], &at_once))
    return nullptr;
  int found = 0;
  MPI_Message message;
  MPI_Status status;
  int code = MPI_Improbe(MPI_ANY_SOURCE, tag, comm, &found, &message, &status);
  if (code != MPI_SUCCESS) return fail(code, -1);
  if (!found) Py_RETURN_NONE;
  int source = status.MPI_SOURCE, count = 0;
  MPI_Get_count(&status, MPI_BYTE, &count);
  if (count > at_once) {
    PyObject* matched = handle_to_python(message);
    if (matched == nullptr) return nullptr;
    return Py_BuildValue("(iiOON)", source, count, Py_None, Py_None, matched);
  }
  PyObject* buffer = PyByteArray_FromStringAndSize(nullptr, count);
  if (buffer == nullptr) return nullptr;  // (the message stays matched: not seen)
  code = MPI_Mrecv(PyByteArray_AS_STRING(buffer), count, MPI_BYTE, &message, &status);
  if (code != MPI_SUCCESS) {
    Py_DECREF(buffer);
    return fail(code, source);
  }
  PyObject* more[2] = {buffer, Py_None};
  PyObject* result = read_message(args[3], buffer, count, source, args[4], args[5], more, 2);
  Py_DECREF(buffer);
  return result;
}

// allreduce(request, stage, user, nbytes, tests): a kept all-reduce (``mpi_reduce``):
// copy ``nbytes`` from address ``user`` into ``stage`` (the persistent request's buffer),
// start ``request`` and test it up to ``tests`` times; True, the result copied back to
// ``user``, if it completed, else False (in flight: the caller follows it). The caller
// owns both buffers, of ``nbytes`` each (addresses of its own tensors).
PyObject* allreduce(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "allreduce(request, stage, user, nbytes, tests)");
    return nullptr;
  }
  MPI_Request request = handle_of<MPI_Request>(args[0]);
  void* stage = PyLong_AsVoidPtr(args[1]);
  void* user = PyLong_AsVoidPtr(args[2]);
  Py_ssize_t nbytes = PyLong_AsSsize_t(args[3]);
  long tests = PyLong_AsLong(args[4]);
  if (PyErr_Occurred()) return nullptr;
  if (stage == nullptr || user == nullptr || nbytes < 0) {
    PyErr_SetString(PyExc_ValueError, "allreduce: no buffer");
    return nullptr;
  }
  std::memcpy(stage, user, static_cast<size_t>(nbytes));
  int code = MPI_Start(&request);
  if (code != MPI_SUCCESS) return fail(code, -1);
  for (long i = 0; i < tests; i++) {
    int done = 0;
    code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) return fail(code, -1);
    if (done) {
      std::memcpy(user, stage, static_cast<size_t>(nbytes));
      Py_RETURN_TRUE;
    }
  }
  Py_RETURN_FALSE;
}

// test(request): test the request of a quick operation in flight (its handle, as
// ``send`` and ``recv`` return it); whether it is done (then freed). mpi4py's ``Test``
// needs a request object, whose making (``Request.fromhandle``) costs as much as the
// operation's issue: a task that awaits it tests it here, and only one that parks has
// the object made (``Poller.follow_handle``).
PyObject* test(PyObject*, PyObject* arg) {
  MPI_Request request = handle_of<MPI_Request>(arg);
  if (PyErr_Occurred()) return nullptr;
  int done = 0;
  int code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
  if (code != MPI_SUCCESS) return fail(code, -1);
  if (done) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

// start(request): start the persistent receive again (after the lane left a message).
PyObject* start(PyObject*, PyObject* arg) {
  MPI_Request request = handle_of<MPI_Request>(arg);
  if (PyErr_Occurred()) return nullptr;
  int code = MPI_Start(&request);
  if (code != MPI_SUCCESS) return fail(code, -1);
  Py_RETURN_NONE;
}

PyObject* library(PyObject*, PyObject*) {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(version, &length);
  return PyUnicode_DecodeUTF8(version, length, "replace");
}

// -- the calls of a compiled lane (``small.cpp``'s ``Lane``), through a capsule ----------
//
// The lane is built without MPI: it sends its packets and tests its receive through these
// (the layout of ``LaneCalls`` is the lane's; ``version`` says which).

struct LaneCalls {
  int version;
  // send ``len`` bytes to ``dst`` on ``tag``: 0 done, else MPI's error code; a send still
  // in flight leaves its request's handle in ``pending`` (else 0)
  int (*send)(uint64_t comm, const char* buf, Py_ssize_t len, int dst, int tag,
              uint64_t* pending);
  // test a persistent receive: 0 (``done``, its ``source`` and byte ``count`` set), else
  // MPI's error code (``source`` set)
  int (*test)(uint64_t request, int* done, int* source, int* count);
  int (*start)(uint64_t request);  // start it again: 0, else MPI's error code
};

int lane_test(uint64_t request, int* done, int* source, int* count) {
  MPI_Request r = handle_bits<MPI_Request>(request);
  MPI_Status status;
  *done = 0;
  int code = MPI_Test(&r, done, &status);
  if (code != MPI_SUCCESS || *done) *source = status.MPI_SOURCE;
  if (code == MPI_SUCCESS && *done) MPI_Get_count(&status, MPI_BYTE, count);
  return code;
}

int lane_start(uint64_t request) {
  MPI_Request r = handle_bits<MPI_Request>(request);
  return MPI_Start(&r);
}

LaneCalls lane_calls = {1, lane_send, lane_test, lane_start};

PyMethodDef methods[] = {
    {"isend", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(isend)),
     METH_FASTCALL, "isend(comm, buffer, dst, tag): None if sent at once, else a request"},
    {"probe", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(probe)),
     METH_FASTCALL, "probe(comm, tag, at_once, unpack, max_ndim, message_type)"},
    {"allreduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(allreduce)),
     METH_FASTCALL, "allreduce(request, stage, user, nbytes, tests) -> whether done"},
    {"send", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(send)), METH_FASTCALL,
     "send(comm, address, nbytes, datatype, dst, tag) -> None (done) | request handle"},
    {"recv", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(recv)), METH_FASTCALL,
     "recv(comm, address, nbytes, datatype, src, tag) -> None (done) | request handle"},
    {"test", test, METH_O, "test(request) -> whether a quick operation's request is done"},
    {"start", start, METH_O, "start(request): start a persistent receive again"},
    {"library", library, METH_NOARGS, "the MPI library's version string"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, nullptr, "asyncomm's compiled MPI calls", -1,
                      methods};

}  // namespace

// (torch's extension loader names the module: TORCH_EXTENSION_NAME)
#define ASYNCOMM_CONCAT(a, b) a##b
#define ASYNCOMM_INIT(name) ASYNCOMM_CONCAT(PyInit_, name)
#define ASYNCOMM_QUOTE(name) #name
#define ASYNCOMM_STRING(name) ASYNCOMM_QUOTE(name)

PyMODINIT_FUNC ASYNCOMM_INIT(TORCH_EXTENSION_NAME)(void) {
  module.m_name = ASYNCOMM_STRING(TORCH_EXTENSION_NAME);
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  Error = PyErr_NewException("asyncomm_mpi.Error", PyExc_RuntimeError, nullptr);
  if (Error == nullptr || PyModule_AddObjectRef(m, "Error", Error) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  PyObject* calls = PyCapsule_New(&lane_calls, "asyncomm.lane_calls", nullptr);
  if (calls == nullptr || PyModule_AddObject(m, "lane_calls", calls) < 0) {
    Py_XDECREF(calls);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
