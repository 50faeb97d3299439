// The tensor work of small frames, compiled: what asyncomm._core.small does for a lone
// tensor's message when it is sent, and for a tensor laid inline when it arrives.
//
// Built by ``asyncomm build`` (torch's C++ extension loader); asyncomm runs without it,
// and everything here has a Python twin in ``small`` that writes and reads the same bytes
// (see asyncomm/_native/__init__.py). Only the commonest cases are taken here; for any
// other this says so (``encode``: None) or hands the call to the Python twin
// (``inline``), so the rules live in one place. Every function holds the GIL throughout
// and lets no C++ exception out.

#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr long EXT_INLINE = 3;  // msgpack extension code of an inline buffer
constexpr uint8_t TENSOR = 0;   // BufferKind.TENSOR
constexpr Py_ssize_t ROOM_LEFT = 256;  // encode's margin: a lone tensor's body <= room - this
constexpr uint8_t DATA = 1, RUN = 7;   // a small frame's kinds: a message, a run of messages

// A descriptor (as in a frame's head): code, kind, ndim (uint8 each), then ndim + 1 uint64
// little-endian: the shape, then the bytes.
constexpr size_t descriptor_bytes(size_t ndim) { return 3 + 8 * (ndim + 1); }

std::unordered_map<int, uint8_t> codes;             // ScalarType -> asyncomm's dtype code
std::unordered_map<int, at::ScalarType> dtypes;     // code -> ScalarType

// The descriptors of inline tensors that small's Python twin checked and kept: a payload
// that starts with one and holds its bytes exactly is made here, with no checks more.
struct Kept {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t nbytes;
};
std::unordered_map<std::string, Kept> kept;
const std::pair<const std::string, Kept>* last = nullptr;  // the one found last (a stream's)

void put_u64(char* p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// setup(table): table is a list of (code, an empty tensor of that dtype).
PyObject* setup(PyObject*, PyObject* table) {
  try {
    if (!PyList_Check(table)) {
      PyErr_SetString(PyExc_TypeError, "setup(table): a list of (code, tensor)");
      return nullptr;
    }
    codes.clear();
    dtypes.clear();
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(table); i++) {
      PyObject* item = PyList_GET_ITEM(table, i);
      if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2 ||
          !THPVariable_Check(PyTuple_GET_ITEM(item, 1))) {
        PyErr_SetString(PyExc_TypeError, "setup(table): a list of (code, tensor)");
        return nullptr;
      }
      long code = PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
      if (code < 0 || code > 255) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a dtype code beyond 255");
        return nullptr;
      }
      at::ScalarType dtype = THPVariable_Unpack(PyTuple_GET_ITEM(item, 1)).scalar_type();
      codes[static_cast<int>(dtype)] = static_cast<uint8_t>(code);
      dtypes[static_cast<int>(code)] = dtype;
    }
    Py_RETURN_NONE;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// encode(tensor, room, max_ndim) -> bytes | None: a lone tensor's small-frame body (an
// inline extension: its head, the descriptor, the bytes), for an exact torch.Tensor laid
// out as it lies in host memory (strided, contiguous, no conj or neg bit) of a known dtype,
// of at most max_ndim dims and room - 256 bytes; None for any other (small's twin decides).
PyObject* encode(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (nargs != 3) {
      PyErr_SetString(PyExc_TypeError, "encode(tensor, room, max_ndim)");
      return nullptr;
    }
    // (exactly torch.Tensor: THPVariable_CheckExact lets torch.nn.Parameter in too)
    if (reinterpret_cast<PyObject*>(Py_TYPE(args[0])) != THPVariableClass) Py_RETURN_NONE;
    Py_ssize_t room = PyLong_AsSsize_t(args[1]);
    Py_ssize_t max_ndim = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return nullptr;
    const at::Tensor& t = THPVariable_Unpack(args[0]);
    if (t.layout() != at::kStrided || !t.device().is_cpu() || t.is_neg() || t.is_conj() ||
        !t.is_contiguous())
      Py_RETURN_NONE;
    auto code = codes.find(static_cast<int>(t.scalar_type()));
    int64_t ndim = t.dim();
    if (code == codes.end() || ndim > max_ndim || ndim > 255) Py_RETURN_NONE;
    int64_t nbytes = static_cast<int64_t>(t.nbytes());
    if (nbytes > room - ROOM_LEFT) Py_RETURN_NONE;
    size_t size = descriptor_bytes(ndim) + nbytes;
    size_t head = size < (1u << 8) ? 3 : size < (1u << 16) ? 4 : 6;
    PyObject* out = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(head + size));
    if (out == nullptr) return nullptr;
    char* p = PyBytes_AS_STRING(out);
    if (head == 3) {  // fixed ext 8 / 16 / 32: the marker, the size (big-endian), the code
      p[0] = static_cast<char>(0xc7);
      p[1] = static_cast<char>(size);
    } else if (head == 4) {
      p[0] = static_cast<char>(0xc8);
      p[1] = static_cast<char>(size >> 8);
      p[2] = static_cast<char>(size & 0xff);
    } else {
      p[0] = static_cast<char>(0xc9);
      for (int i = 0; i < 4; i++) p[1 + i] = static_cast<char>((size >> (8 * (3 - i))) & 0xff);
    }
    p[head - 1] = static_cast<char>(EXT_INLINE);
    p += head;
    p[0] = static_cast<char>(code->second);
    p[1] = static_cast<char>(TENSOR);
    p[2] = static_cast<char>(ndim);
    for (int64_t i = 0; i < ndim; i++) put_u64(p + 3 + 8 * i, static_cast<uint64_t>(t.size(i)));
    put_u64(p + 3 + 8 * ndim, static_cast<uint64_t>(nbytes));
    if (nbytes) std::memcpy(p + descriptor_bytes(ndim), t.data_ptr(), nbytes);
    return out;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// keep(descriptor): a descriptor small's twin checked (a non-empty tensor of a dtype every
// byte pattern is valid for): inline payloads that start with it are made here from now on.
PyObject* keep(PyObject*, PyObject* raw) {
  try {
    if (!PyBytes_Check(raw) || PyBytes_GET_SIZE(raw) < 3) {
      PyErr_SetString(PyExc_TypeError, "keep(descriptor: bytes)");
      return nullptr;
    }
    const char* p = PyBytes_AS_STRING(raw);
    size_t ndim = static_cast<uint8_t>(p[2]);
    auto dtype = dtypes.find(static_cast<uint8_t>(p[0]));
    if (static_cast<size_t>(PyBytes_GET_SIZE(raw)) != descriptor_bytes(ndim) ||
        dtype == dtypes.end() || static_cast<uint8_t>(p[1]) != TENSOR) {
      PyErr_SetString(PyExc_ValueError, "keep: not a tensor's descriptor of a known dtype");
      return nullptr;
    }
    Kept k{dtype->second, {}, static_cast<int64_t>(get_u64(p + 3 + 8 * ndim))};
    for (size_t i = 0; i < ndim; i++) k.shape.push_back(static_cast<int64_t>(get_u64(p + 3 + 8 * i)));
    if (kept.size() >= 1024) {
      kept.clear();
      last = nullptr;
    }
    kept[std::string(p, PyBytes_GET_SIZE(raw))] = std::move(k);
    Py_RETURN_NONE;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* forget(PyObject*, PyObject*) {
  kept.clear();
  last = nullptr;
  Py_RETURN_NONE;
}

// A fresh tensor of an inline payload whose descriptor is kept, of at most max_ndim dims,
// holding its bytes exactly; an undefined one for any other payload.
at::Tensor made(const char* p, size_t size, long max_ndim) {
  if (kept.empty() || size < 3) return at::Tensor();
  size_t ndim = static_cast<uint8_t>(p[2]);
  size_t at = descriptor_bytes(ndim);
  if (static_cast<long>(ndim) > max_ndim || size < at) return at::Tensor();
  if (last == nullptr || last->first.size() != at || std::memcmp(last->first.data(), p, at)) {
    auto k = kept.find(std::string(p, at));
    if (k == kept.end()) return at::Tensor();
    last = &*k;
  }
  const Kept& k = last->second;
  if (static_cast<int64_t>(size - at) != k.nbytes) return at::Tensor();
  at::Tensor t = at::empty(k.shape, at::TensorOptions().dtype(k.dtype));
  std::memcpy(t.data_ptr(), p + at, size - at);
  return t;
}

// inline(twin, max_ndim, code, payload): msgpack's extension hook for small frames (bound
// to its first two arguments). A tensor whose descriptor is kept, of at most max_ndim
// dims, with its bytes exactly: a fresh tensor of them; anything else: twin(code, payload).
PyObject* inline_(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (nargs != 4) {
      PyErr_SetString(PyExc_TypeError, "inline(twin, max_ndim, code, payload)");
      return nullptr;
    }
    PyObject* payload = args[3];
    if (!kept.empty() && PyLong_CheckExact(args[2]) && PyBytes_CheckExact(payload) &&
        PyLong_AsLong(args[2]) == EXT_INLINE) {
      long max_ndim = PyLong_AsLong(args[1]);
      if (PyErr_Occurred()) return nullptr;
      at::Tensor t = made(PyBytes_AS_STRING(payload),
                          static_cast<size_t>(PyBytes_GET_SIZE(payload)), max_ndim);
      if (t.defined()) return THPVariable_Wrap(std::move(t));
    }
    return PyObject_Vectorcall(args[0], args + 2, 2, nullptr);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// Reads a packet (see asyncomm._core.link) of the commonest kind only: every frame a message
// or a run of messages, each message a lone tensor made by ``made``; false for any other.
struct Reader {
  const uint8_t* p;
  size_t left;
  long max_ndim;

  bool byte(uint8_t& out) {
    if (!left) return false;
    out = *p++;
    left--;
    return true;
  }
  bool big(size_t n, uint64_t& out) {  // an n-byte big-endian unsigned
    if (left < n) return false;
    out = 0;
    for (size_t i = 0; i < n; i++) out = (out << 8) | p[i];
    p += n;
    left -= n;
    return true;
  }
  bool u64(uint64_t& out) {
    uint8_t marker;
    return byte(marker) && marker == 0xcf && big(8, out);
  }
  bool array32(uint64_t& count) {
    uint8_t marker;
    return byte(marker) && marker == 0xdd && big(4, count);
  }
  // A lone tensor's body: an inline extension whose tensor ``made`` makes; a new reference.
  PyObject* tensor() {
    uint8_t marker;
    uint64_t size = 0;
    if (!byte(marker)) return nullptr;
    if (!(marker == 0xc7 ? big(1, size) : marker == 0xc8 ? big(2, size)
          : marker == 0xc9 ? big(4, size) : false))
      return nullptr;
    uint8_t code;
    if (!byte(code) || code != EXT_INLINE || left < size) return nullptr;
    at::Tensor t;
    try {
      t = made(reinterpret_cast<const char*>(p), size, max_ndim);
    } catch (const std::exception&) {
      return nullptr;  // (no memory for it: the Python twin meets that again)
    }
    if (!t.defined()) return nullptr;
    p += size;
    left -= size;
    return THPVariable_Wrap(std::move(t));
  }
};

// unpack_packet(data, max_ndim) -> list | None: the frames of a packet as
// ``small.unpack_packet`` returns them ([kind, tag, seq, message or list of messages]), if it
// holds only messages that are lone tensors of kept descriptors; None for any other (the
// Python twin reads it, refuses what is malformed, and keeps the descriptors it checks).
PyObject* unpack_packet(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "unpack_packet(data, max_ndim)");
    return nullptr;
  }
  long max_ndim = PyLong_AsLong(args[1]);
  if (PyErr_Occurred()) return nullptr;
  Py_buffer view;
  if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return nullptr;
  PyObject* items = nullptr;
  {
    Reader r{static_cast<const uint8_t*>(view.buf), static_cast<size_t>(view.len), max_ndim};
    uint64_t count;
    bool whole = !kept.empty() && r.array32(count) && count <= r.left;
    items = whole ? PyList_New(static_cast<Py_ssize_t>(count)) : nullptr;
    for (uint64_t i = 0; whole && items != nullptr && i < count; i++) {
      uint8_t head, kind;
      uint64_t tag, seq, messages = 1;
      whole = r.byte(head) && head == 0x94 && r.byte(kind) && (kind == DATA || kind == RUN) &&
              r.u64(tag) && r.u64(seq) && (kind == DATA || r.array32(messages)) &&
              messages <= r.left;
      PyObject* data = !whole ? nullptr : kind == DATA ? r.tensor()
                       : PyList_New(static_cast<Py_ssize_t>(messages));
      for (uint64_t j = 0; data != nullptr && kind == RUN && j < messages; j++) {
        PyObject* message = r.tensor();
        if (message == nullptr) Py_CLEAR(data);
        else PyList_SET_ITEM(data, static_cast<Py_ssize_t>(j), message);
      }
      PyObject* item = data == nullptr ? nullptr
                       : Py_BuildValue("[iKKN]", kind, static_cast<unsigned long long>(tag),
                                       static_cast<unsigned long long>(seq), data);
      if (item == nullptr) {  // (Py_BuildValue's N steals data even where it fails)
        whole = false;
        break;
      }
      PyList_SET_ITEM(items, static_cast<Py_ssize_t>(i), item);
    }
    if (!whole || r.left) Py_CLEAR(items);
  }
  PyBuffer_Release(&view);
  if (items == nullptr) {
    PyErr_Clear();  // (a failed allocation is the Python twin's to meet again)
    Py_RETURN_NONE;
  }
  return items;
}

PyMethodDef methods[] = {
    {"setup", setup, METH_O, "setup(table): the dtype codes, as (code, empty tensor)"},
    {"encode", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(encode)),
     METH_FASTCALL, "encode(tensor, room, max_ndim) -> bytes | None"},
    {"keep", keep, METH_O, "keep(descriptor): a tensor descriptor, checked"},
    {"forget", forget, METH_NOARGS, "forget(): no descriptor kept"},
    {"inline", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(inline_)),
     METH_FASTCALL, "inline(twin, max_ndim, code, payload) -> object"},
    {"unpack_packet", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(unpack_packet)),
     METH_FASTCALL, "unpack_packet(data, max_ndim) -> list | None"},
    {nullptr, nullptr, 0, nullptr}};

#define ASYNCOMM_STR2(name) #name
#define ASYNCOMM_STR(name) ASYNCOMM_STR2(name)

PyModuleDef module = {PyModuleDef_HEAD_INIT, ASYNCOMM_STR(TORCH_EXTENSION_NAME),
                      "The tensor work of small frames, compiled", -1, methods};

}  // namespace

#define ASYNCOMM_INIT2(name) PyInit_##name
#define ASYNCOMM_INIT(name) ASYNCOMM_INIT2(name)

PyMODINIT_FUNC ASYNCOMM_INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
