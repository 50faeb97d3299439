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
#include <torch/csrc/DynamicTypes.h>
#include <ATen/EmptyTensor.h>
#include <structmember.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr long EXT_INLINE = 3;  // msgpack extension code of an inline buffer
constexpr uint8_t TENSOR = 0;   // BufferKind.TENSOR
constexpr Py_ssize_t ROOM_LEFT = 256;  // encode's margin: a lone tensor's body <= room - this
constexpr uint8_t DATA = 1, RUN = 7;  // a small frame's kinds: a message, a run of messages

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
std::unordered_map<std::string, PyObject*> keys;  // short str keys of maps (see Reader::key)

void put_u64(char* p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

void put_u32_le(std::string& s, size_t at, uint32_t v) {
  for (int i = 0; i < 4; i++) s[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// Whether a fast call has ``want`` arguments; if not, a TypeError saying ``usage`` is set.
bool arity(Py_ssize_t nargs, Py_ssize_t want, const char* usage) {
  if (nargs == want) return true;
  PyErr_SetString(PyExc_TypeError, usage);
  return false;
}

// setup(table): table is a list of (code, an empty tensor of that dtype).
PyObject* setup(PyObject*, PyObject* table) {
  try {
    if (!PyList_Check(table)) {
      PyErr_SetString(PyExc_TypeError, "setup(table): a list of (code, tensor)");
      return nullptr;
    }
    std::unordered_map<int, uint8_t> new_codes;
    std::unordered_map<int, at::ScalarType> new_dtypes;
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
      new_codes[static_cast<int>(dtype)] = static_cast<uint8_t>(code);
      new_dtypes[static_cast<int>(code)] = dtype;
    }
    codes.swap(new_codes);  // (all or nothing: a table refused changes nothing)
    dtypes.swap(new_dtypes);
    Py_RETURN_NONE;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// A tensor as an inline extension takes it: exactly torch.Tensor (THPVariable_CheckExact
// lets torch.nn.Parameter in too), laid out as it lies in host memory (strided, contiguous,
// no conj or neg bit), of a known dtype and at most max_ndim dims; its code, or -1.
int laid_out(PyObject* obj, Py_ssize_t max_ndim) {
  if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) != THPVariableClass) return -1;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.layout() != at::kStrided || !t.device().is_cpu() || t.is_neg() || t.is_conj() ||
      !t.is_contiguous() || t.dim() > max_ndim || t.dim() > 255)
    return -1;
  auto code = codes.find(static_cast<int>(t.scalar_type()));
  return code == codes.end() ? -1 : code->second;
}

// span(tensor, table): where a tensor a backend's quick operations move lies, in one call
// (each of torch's attributes costs a call in Python): (address, bytes, table[dtype]) for
// exactly a torch.Tensor laid out in host memory (as ``laid_out``) whose dtype has an
// entry in ``table`` (not None) and whose elements a C int counts; else None (the
// backend's usual path takes it, and words what is wrong with it). Its Python twin is
// ``small.span``.
PyObject* span(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyDict_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "span(tensor, table)");
    return nullptr;
  }
  PyObject* obj = args[0];
  if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) != THPVariableClass) Py_RETURN_NONE;
  void* data = nullptr;
  size_t nbytes = 0;
  at::ScalarType dtype = at::ScalarType::Undefined;
  try {  // (a tensor torch cannot answer for, as one without storage: the usual path's)
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.layout() != at::kStrided || !t.device().is_cpu() || t.is_neg() || t.is_conj() ||
        !t.is_contiguous() || t.numel() > INT32_MAX)
      Py_RETURN_NONE;
    dtype = t.scalar_type();
    data = t.data_ptr();
    nbytes = t.nbytes();
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
  PyObject* value =
      PyDict_GetItem(args[1], reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype)));
  if (value == nullptr || value == Py_None) Py_RETURN_NONE;  // (an entry None: none)
  PyObject* result = PyTuple_New(3);
  if (result == nullptr) return nullptr;
  PyObject* address = PyLong_FromVoidPtr(data);
  PyObject* size = PyLong_FromSsize_t(static_cast<Py_ssize_t>(nbytes));
  Py_INCREF(value);
  PyTuple_SET_ITEM(result, 0, address);
  PyTuple_SET_ITEM(result, 1, size);
  PyTuple_SET_ITEM(result, 2, value);
  if (address == nullptr || size == nullptr) {
    Py_DECREF(result);
    return nullptr;
  }
  return result;
}

// The inline extension of tensor ``t`` (of dtype ``code``) into ``out``: the extension's
// head (ext 8 / 16 / 32: the marker, the size big-endian, the code), the descriptor, the bytes.
void put_tensor(std::string& out, const at::Tensor& t, int code) {
  int64_t ndim = t.dim(), nbytes = static_cast<int64_t>(t.nbytes());
  size_t size = descriptor_bytes(ndim) + nbytes;
  size_t at = out.size();
  size_t head = size < (1u << 8) ? 3 : size < (1u << 16) ? 4 : 6;
  out.resize(at + head + size);
  char* p = out.data() + at;
  if (head == 3) {
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
  p[0] = static_cast<char>(code);
  p[1] = static_cast<char>(TENSOR);
  p[2] = static_cast<char>(ndim);
  for (int64_t i = 0; i < ndim; i++) put_u64(p + 3 + 8 * i, static_cast<uint64_t>(t.size(i)));
  put_u64(p + 3 + 8 * ndim, static_cast<uint64_t>(nbytes));
  if (nbytes) std::memcpy(p + descriptor_bytes(ndim), t.data_ptr(), nbytes);
}

void put_big(std::string& out, uint8_t marker, uint64_t v, int n) {
  out.push_back(static_cast<char>(marker));
  for (int i = n - 1; i >= 0; i--) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// A scalar as msgpack (use_bin_type) packs it: None, bool, int, float, str, exactly those
// types; false for any other (or an int beyond 64 bits, a str that is not UTF-8).
bool put_scalar(std::string& out, PyObject* x) {
  if (x == Py_None) {
    out.push_back(static_cast<char>(0xc0));
  } else if (x == Py_True || x == Py_False) {
    out.push_back(static_cast<char>(x == Py_True ? 0xc3 : 0xc2));
  } else if (PyLong_CheckExact(x)) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow < 0 || (v == -1 && PyErr_Occurred())) return false;
    if (overflow > 0) {
      unsigned long long u = PyLong_AsUnsignedLongLong(x);
      if (PyErr_Occurred()) return false;
      put_big(out, 0xcf, u, 8);
    } else if (v >= 0) {
      if (v < 128) out.push_back(static_cast<char>(v));
      else if (v < 256) put_big(out, 0xcc, v, 1);
      else if (v < 65536) put_big(out, 0xcd, v, 2);
      else if (v < 4294967296LL) put_big(out, 0xce, v, 4);
      else put_big(out, 0xcf, v, 8);
    } else {
      if (v >= -32) out.push_back(static_cast<char>(v));
      else if (v >= -128) put_big(out, 0xd0, static_cast<uint8_t>(v), 1);
      else if (v >= -32768) put_big(out, 0xd1, static_cast<uint16_t>(v), 2);
      else if (v >= -2147483648LL) put_big(out, 0xd2, static_cast<uint32_t>(v), 4);
      else put_big(out, 0xd3, static_cast<uint64_t>(v), 8);
    }
  } else if (PyFloat_CheckExact(x)) {
    double d = PyFloat_AS_DOUBLE(x);
    uint64_t bits;
    std::memcpy(&bits, &d, 8);
    put_big(out, 0xcb, bits, 8);
  } else if (PyUnicode_CheckExact(x)) {
    Py_ssize_t n;
    const char* utf8 = PyUnicode_AsUTF8AndSize(x, &n);
    if (utf8 == nullptr) return false;
    if (n < 32) out.push_back(static_cast<char>(0xa0 | n));
    else if (n < 256) put_big(out, 0xd9, n, 1);
    else if (n < 65536) put_big(out, 0xda, n, 2);
    else put_big(out, 0xdb, static_cast<uint64_t>(n), 4);
    out.append(utf8, static_cast<size_t>(n));
  } else {
    return false;
  }
  return true;
}

// A value as small's twin lays it out, into ``out``: a scalar (``put_scalar``), a tensor
// laid out as it lies (``laid_out``: an inline extension), or a list or dict of them (a dict's
// keys str or int), nested at most 32 deep, stopping once ``out`` holds more than ``room``
// bytes; false for any other (the twin lowers it, or refuses it).
bool put_value(std::string& out, PyObject* x, Py_ssize_t room, Py_ssize_t max_ndim, int depth) {
  if (depth > 32 || static_cast<Py_ssize_t>(out.size()) > room) return false;
  int code = laid_out(x, max_ndim);
  if (code >= 0) {
    const at::Tensor& t = THPVariable_Unpack(x);
    if (static_cast<Py_ssize_t>(t.nbytes()) > room) return false;
    put_tensor(out, t, code);
  } else if (PyList_CheckExact(x)) {
    Py_ssize_t n = PyList_GET_SIZE(x);
    if (n < 16) out.push_back(static_cast<char>(0x90 | n));
    else if (n < 65536) put_big(out, 0xdc, n, 2);
    else put_big(out, 0xdd, static_cast<uint64_t>(n), 4);
    for (Py_ssize_t i = 0; i < n; i++)
      if (!put_value(out, PyList_GET_ITEM(x, i), room, max_ndim, depth + 1)) return false;
  } else if (PyDict_CheckExact(x)) {
    Py_ssize_t n = PyDict_GET_SIZE(x), at = 0;
    if (n < 16) out.push_back(static_cast<char>(0x80 | n));
    else if (n < 65536) put_big(out, 0xde, n, 2);
    else put_big(out, 0xdf, static_cast<uint64_t>(n), 4);
    PyObject *key, *value;
    while (PyDict_Next(x, &at, &key, &value))
      if (!(PyUnicode_CheckExact(key) || PyLong_CheckExact(key)) || !put_scalar(out, key) ||
          !put_value(out, value, room, max_ndim, depth + 1))
        return false;
  } else {
    return put_scalar(out, x);
  }
  return true;
}

// encode(obj, room, max_ndim) -> bytes | None: the small-frame body of a lone tensor (of at
// most room - 256 bytes), or of a list or dict of scalars (None, bool, int, float, str),
// tensors, lists and dicts (at most ``room`` bytes), as small's twin lays them out; None for
// any other (the twin decides).
// A small frame's body of ``obj`` into ``out``: 1 done, 0 not one (the Python twin's or a
// frame's), -1 an error set. (``encode``'s and the outbox's ``message``'s.)
int encode_into(std::string& out, PyObject* obj, Py_ssize_t room, Py_ssize_t max_ndim) {
  try {
    if (PyList_CheckExact(obj) || PyDict_CheckExact(obj)) {
      if (!put_value(out, obj, room, max_ndim, 0) || static_cast<Py_ssize_t>(out.size()) > room) {
        PyErr_Clear();
        return 0;
      }
      return 1;
    }
    int code = laid_out(obj, max_ndim);
    if (code < 0) return 0;
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (static_cast<Py_ssize_t>(t.nbytes()) > room - ROOM_LEFT) return 0;
    put_tensor(out, t, code);
    return 1;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return -1;
  }
}

PyObject* encode(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "encode(obj, room, max_ndim)")) return nullptr;
  Py_ssize_t room = PyLong_AsSsize_t(args[1]);
  Py_ssize_t max_ndim = PyLong_AsSsize_t(args[2]);
  if (PyErr_Occurred()) return nullptr;
  std::string out;
  int done = encode_into(out, args[0], room, max_ndim);
  if (done < 0) return nullptr;
  if (done == 0) Py_RETURN_NONE;
  return PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size()));
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
    // (its bytes must be its shape's, in a tensor of at most 2**62 bytes: else a payload
    // of its declared bytes would overrun the tensor made for its shape)
    uint64_t nbytes = get_u64(p + 3 + 8 * ndim), product = c10::elementSize(dtype->second);
    Kept k{dtype->second, {}, static_cast<int64_t>(nbytes)};
    for (size_t i = 0; i < ndim; i++) {
      uint64_t size = get_u64(p + 3 + 8 * i);
      if (__builtin_mul_overflow(product, size, &product) || product > (uint64_t{1} << 62)) {
        product = ~uint64_t{0};
        break;
      }
      k.shape.push_back(static_cast<int64_t>(size));
    }
    if (product != nbytes || nbytes == 0) {
      PyErr_SetString(PyExc_ValueError, "keep: a descriptor whose bytes are not its shape's");
      return nullptr;
    }
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
at::TensorBase made(const char* p, size_t size, long max_ndim) {
  if (kept.empty() || size < 3) return at::TensorBase();
  size_t ndim = static_cast<uint8_t>(p[2]);
  size_t at = descriptor_bytes(ndim);
  if (static_cast<long>(ndim) > max_ndim || size < at) return at::TensorBase();
  if (last == nullptr || last->first.size() != at || std::memcmp(last->first.data(), p, at)) {
    auto k = kept.find(std::string(p, at));
    if (k == kept.end()) return at::TensorBase();
    last = &*k;
  }
  const Kept& k = last->second;
  if (static_cast<int64_t>(size - at) != k.nbytes) return at::TensorBase();
  // (the CPU allocator's own call: at::empty's dispatch costs as much as the rest)
  at::TensorBase t = at::detail::empty_cpu(k.shape, k.dtype);
  std::memcpy(t.data_ptr(), p + at, size - at);
  return t;
}

// inline(twin, max_ndim, code, payload): msgpack's extension hook for small frames (bound
// to its first two arguments). A tensor whose descriptor is kept, of at most max_ndim
// dims, with its bytes exactly: a fresh tensor of them; anything else: twin(code, payload).
PyObject* inline_(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (!arity(nargs, 4, "inline(twin, max_ndim, code, payload)")) return nullptr;
    PyObject* payload = args[3];
    int overflow = 0;
    if (!kept.empty() && PyLong_CheckExact(args[2]) && PyBytes_CheckExact(payload) &&
        PyLong_AsLongAndOverflow(args[2], &overflow) == EXT_INLINE) {
      long max_ndim = PyLong_AsLong(args[1]);
      if (PyErr_Occurred()) return nullptr;
      at::TensorBase t = made(PyBytes_AS_STRING(payload),
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
  bool skip(uint64_t n, const uint8_t*& at) {
    if (left < n) return false;
    at = p;
    p += n;
    left -= n;
    return true;
  }
  // An inline extension's payload of ``size`` bytes made a tensor by ``made``.
  PyObject* tensor(uint64_t size) {
    uint8_t code;
    const uint8_t* at;
    if (!byte(code) || code != EXT_INLINE || !skip(size, at)) return nullptr;
    at::TensorBase t;
    try {
      t = made(reinterpret_cast<const char*>(at), size, max_ndim);
    } catch (const std::exception&) {
      return nullptr;  // (no memory for it: the Python twin meets that again)
    }
    return t.defined() ? THPVariable_Wrap(std::move(t)) : nullptr;
  }
  PyObject* text(uint64_t n) {
    const uint8_t* at;
    if (!skip(n, at)) return nullptr;
    return PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(at), static_cast<Py_ssize_t>(n),
                                nullptr);
  }
  PyObject* array(uint64_t n, int depth) {
    PyObject* list = n <= left ? PyList_New(static_cast<Py_ssize_t>(n)) : nullptr;
    for (uint64_t i = 0; list != nullptr && i < n; i++) {
      PyObject* item = value(depth + 1);
      if (item == nullptr) Py_CLEAR(list);
      else PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
    }
    return list;
  }
  // A map's key: a short str is taken from ``keys`` (made, interned and kept there the
  // first time: the keys of a stream of dicts repeat, and a kept str's hash is known).
  PyObject* key(int depth) {
    if (!left || (*p & 0xe0) != 0xa0) return value(depth);
    size_t n = *p & 0x1f;
    if (left < 1 + n) return nullptr;
    std::string text(reinterpret_cast<const char*>(p + 1), n);
    auto kept_key = keys.find(text);
    if (kept_key != keys.end()) {
      p += 1 + n;
      left -= 1 + n;
      Py_INCREF(kept_key->second);
      return kept_key->second;
    }
    PyObject* made_key = value(depth);
    if (made_key != nullptr && keys.size() < 1024) {
      PyUnicode_InternInPlace(&made_key);
      Py_INCREF(made_key);
      keys.emplace(std::move(text), made_key);
    }
    return made_key;
  }
  PyObject* map(uint64_t n, int depth) {
    PyObject* dict = n <= left ? PyDict_New() : nullptr;
    for (uint64_t i = 0; dict != nullptr && i < n; i++) {
      PyObject* key = this->key(depth + 1);
      PyObject* item = key == nullptr ? nullptr : value(depth + 1);
      if (item == nullptr || !(PyUnicode_CheckExact(key) || PyLong_CheckExact(key)) ||
          PyDict_SetItem(dict, key, item) < 0)
        Py_CLEAR(dict);
      Py_XDECREF(key);
      Py_XDECREF(item);
    }
    return dict;
  }
  // A message's body, as msgpack's unpackb decodes a small frame's (see small.unpack_packet):
  // nil, bools, ints, floats, str, bin, arrays, maps of str or int keys, and inline tensors
  // that ``made`` makes; nullptr for anything else (another extension, a tensor not kept, a
  // malformed or truncated body), which the Python twin reads instead.
  PyObject* value(int depth) {
    uint8_t m;
    uint64_t n = 0;
    const uint8_t* at;
    if (depth > 32 || !byte(m)) return nullptr;
    if (m <= 0x7f) return PyLong_FromLong(m);
    if (m >= 0xe0) return PyLong_FromLong(static_cast<int8_t>(m));
    if ((m & 0xe0) == 0xa0) return text(m & 0x1f);
    if ((m & 0xf0) == 0x90) return array(m & 0x0f, depth);
    if ((m & 0xf0) == 0x80) return map(m & 0x0f, depth);
    switch (m) {
      case 0xc0: Py_RETURN_NONE;
      case 0xc2: Py_RETURN_FALSE;
      case 0xc3: Py_RETURN_TRUE;
      case 0xcc: case 0xcd: case 0xce: case 0xcf:
        return big(size_t{1} << (m - 0xcc), n) ? PyLong_FromUnsignedLongLong(n) : nullptr;
      case 0xd0: return big(1, n) ? PyLong_FromLong(static_cast<int8_t>(n)) : nullptr;
      case 0xd1: return big(2, n) ? PyLong_FromLong(static_cast<int16_t>(n)) : nullptr;
      case 0xd2: return big(4, n) ? PyLong_FromLong(static_cast<int32_t>(n)) : nullptr;
      case 0xd3: return big(8, n) ? PyLong_FromLongLong(static_cast<int64_t>(n)) : nullptr;
      case 0xca: {
        if (!big(4, n)) return nullptr;
        uint32_t bits = static_cast<uint32_t>(n);
        float f;
        std::memcpy(&f, &bits, 4);
        return PyFloat_FromDouble(f);
      }
      case 0xcb: {
        if (!big(8, n)) return nullptr;
        double d;
        std::memcpy(&d, &n, 8);
        return PyFloat_FromDouble(d);
      }
      case 0xd9: case 0xda: case 0xdb:
        return big(size_t{1} << (m - 0xd9), n) ? text(n) : nullptr;
      case 0xc4: case 0xc5: case 0xc6:
        if (!big(size_t{1} << (m - 0xc4), n) || !skip(n, at)) return nullptr;
        return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(at),
                                         static_cast<Py_ssize_t>(n));
      case 0xdc: return big(2, n) ? array(n, depth) : nullptr;
      case 0xdd: return big(4, n) ? array(n, depth) : nullptr;
      case 0xde: return big(2, n) ? map(n, depth) : nullptr;
      case 0xdf: return big(4, n) ? map(n, depth) : nullptr;
      case 0xc7: case 0xc8: case 0xc9:
        return big(size_t{1} << (m - 0xc7), n) ? tensor(n) : nullptr;
      default:
        return nullptr;  // a fixext (another extension), or not msgpack
    }
  }
};

// A message of channel ``tag`` from ``src``: ``wrap((src, tag, body))`` (a tuple subclass,
// made as tuple.__new__ makes one); steals ``body``.
PyObject* wrapped(PyTypeObject* wrap, PyObject* src, PyObject* tag, PyObject* body) {
  PyObject* message = body == nullptr ? nullptr : wrap->tp_alloc(wrap, 3);
  if (message == nullptr) {
    Py_XDECREF(body);
    return nullptr;
  }
  Py_INCREF(src);
  Py_INCREF(tag);
  PyTuple_SET_ITEM(message, 0, src);
  PyTuple_SET_ITEM(message, 1, tag);
  PyTuple_SET_ITEM(message, 2, body);
  return message;
}

// The frames of the packet in ``data[0:size]`` (a new list), or nullptr with no error set.
// With ``wrap`` (and ``src``), the bodies of messages (frames of kind DATA, and runs) come
// as messages (``wrapped``), the others as they are.
PyObject* read_packet(const uint8_t* data, size_t size, long max_ndim,
                      PyTypeObject* wrap = nullptr, PyObject* src = nullptr) {
  Reader r{data, size, max_ndim};
  uint64_t count;
  bool whole = r.array32(count) && count <= r.left;
  PyObject* items = whole ? PyList_New(static_cast<Py_ssize_t>(count)) : nullptr;
  for (uint64_t i = 0; whole && items != nullptr && i < count; i++) {
    uint8_t head, kind;
    uint64_t tag, seq, messages = 1;
    whole = r.byte(head) && head == 0x94 && r.byte(kind) && kind < 0x80 && r.u64(tag) &&
            r.u64(seq) && (kind != RUN || r.array32(messages)) && messages <= r.left;
    PyObject* channel = whole && wrap != nullptr && (kind == DATA || kind == RUN)
                        ? PyLong_FromUnsignedLongLong(tag) : nullptr;
    if (whole && wrap != nullptr && (kind == DATA || kind == RUN) && channel == nullptr)
      whole = false;  // (no memory for it)
    PyObject* data = !whole ? nullptr : kind != RUN ? r.value(0)
                     : PyList_New(static_cast<Py_ssize_t>(messages));
    if (channel != nullptr && kind == DATA) data = wrapped(wrap, src, channel, data);
    for (uint64_t j = 0; data != nullptr && kind == RUN && j < messages; j++) {
      PyObject* message = r.value(0);
      if (channel != nullptr) message = wrapped(wrap, src, channel, message);
      if (message == nullptr) Py_CLEAR(data);
      else PyList_SET_ITEM(data, static_cast<Py_ssize_t>(j), message);
    }
    Py_XDECREF(channel);
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
  if (items == nullptr) PyErr_Clear();  // (a failed allocation is the Python twin's to meet)
  return items;
}

PyObject* list_or_none(PyObject* items) {
  if (items != nullptr) return items;
  Py_RETURN_NONE;
}

// unpack_packet(data, max_ndim) -> list | None: the frames of a packet as
// ``small.unpack_packet`` returns them ([kind, tag, seq, body or a run's list of bodies]), if
// every body is one ``Reader::value`` reads (of any kind: a message, credit, a request...);
// None for any other (the Python twin reads it, refuses what is malformed, keeps the
// descriptors it checks; the receiver checks each frame's kind).
PyObject* unpack_packet(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "unpack_packet(data, max_ndim)")) return nullptr;
  long max_ndim = PyLong_AsLong(args[1]);
  if (PyErr_Occurred()) return nullptr;
  Py_buffer view;
  if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return nullptr;
  PyObject* items = read_packet(static_cast<const uint8_t*>(view.buf),
                                static_cast<size_t>(view.len), max_ndim);
  PyBuffer_Release(&view);
  return list_or_none(items);
}

// unpack_message(buffer, count, max_ndim, src, wrap) -> list | None: a link message from
// ``src`` in ``buffer[:count]`` (see asyncomm._core.messages: a preamble of four
// little-endian uint32, head bytes, bytes inline, data messages, form) that is a packet
// (form 1, no head, nothing following), read as ``unpack_packet`` reads it but with its
// messages' bodies made ``wrap((src, tag, body))`` (a tuple type); None for any other.
PyObject* unpack_message(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 5, "unpack_message(buffer, count, max_ndim, src, wrap)")) return nullptr;
  Py_ssize_t count = PyLong_AsSsize_t(args[1]);
  long max_ndim = PyLong_AsLong(args[2]);
  if (PyErr_Occurred()) return nullptr;
  if (!PyLong_CheckExact(args[3]) || !PyType_Check(args[4]) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(args[4]), &PyTuple_Type)) {
    PyErr_SetString(PyExc_TypeError, "unpack_message: src an int, wrap a tuple type");
    return nullptr;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return nullptr;
  PyObject* items = nullptr;
  const uint8_t* p = static_cast<const uint8_t*>(view.buf);
  if (count >= 16 && count <= view.len) {
    uint32_t field[4];
    for (int i = 0; i < 4; i++)
      field[i] = p[4 * i] | (p[4 * i + 1] << 8) | (p[4 * i + 2] << 16) |
                 (static_cast<uint32_t>(p[4 * i + 3]) << 24);
    if (field[0] == 0 && field[2] == 0 && field[3] == 1 && field[1] <= count - 16)
      items = read_packet(p + 16, field[1], max_ndim, reinterpret_cast<PyTypeObject*>(args[4]),
                          args[3]);
  }
  PyBuffer_Release(&view);
  return list_or_none(items);
}

// -- the outbox: small frames queued per destination, as packets ----------------------
//
// The twin of ``_core.outbox.Outbox`` (which says what a packet holds): the same bytes.

constexpr size_t PREAMBLE_BYTES = 16, PACKET_AT = 21;  // messages.PREAMBLE, + PACKET_HEAD
constexpr size_t SMALL_HEAD_BYTES = 20, RUN_MORE_BYTES = 5;  // small.HEAD, RUN_HEAD - HEAD
constexpr size_t TAG_AT = 3, SEQ_AT = 12, COUNT_AT = 21;  // in a head: small.TAG_AT, ...
constexpr uint8_t FRAME_BYTE = 0x94, U64_BYTE = 0xcf, ARRAY_BYTE = 0xdd, PACKET_FORM = 1;

void put_be(std::string& s, size_t at, uint64_t v, int n) {
  for (int i = 0; i < n; i++) s[at + i] = static_cast<char>((v >> (8 * (n - 1 - i))) & 0xff);
}

uint64_t get_be64(const std::string& s, size_t at) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v = (v << 8) | static_cast<uint8_t>(s[at + i]);
  return v;
}

struct Packet {
  std::string bytes = std::string(PACKET_AT, '\0');
  long long frames = 0, items = 0;
  long long next = -1;  // the seq that continues the open run (-1: none open)
  uint64_t run = 0;     // the open run's channel
  size_t run_at = 0;    // where its head begins
  long long run_from = 0;  // ``frames`` when it began
  long long lone = -1;  // where the last item's head begins, a lone message (-1: not one)

  void end_run() {
    put_be(bytes, run_at + COUNT_AT, static_cast<uint64_t>(frames - run_from), 4);
    next = -1;
  }

  void add(uint8_t kind, uint64_t tag, uint64_t seq, const char* body, size_t n) {
    size_t at = bytes.size();
    bytes.resize(at + SMALL_HEAD_BYTES);
    bytes[at] = static_cast<char>(FRAME_BYTE);
    bytes[at + 1] = static_cast<char>(kind);
    bytes[at + 2] = static_cast<char>(U64_BYTE);
    put_be(bytes, at + TAG_AT, tag, 8);
    bytes[at + 11] = static_cast<char>(U64_BYTE);
    put_be(bytes, at + SEQ_AT, seq, 8);
    bytes.append(body, n);
    frames++;
    items++;
  }
};

struct OutboxObject {
  PyObject_HEAD
  std::vector<std::pair<long, Packet>>* packets;  // per destination, in the order begun
  long long packet_bytes;
  long long packet_frames;
  PyObject* encode;  // the Python twin's encoding: what ``message`` leaves, it takes
  // Its link's flush, as ``Link._begun`` asks for it (``attach``; see ``post``): whether
  // packets wait (its flush is in ``due`` then, as ``due_entry``), and whether a flush is
  // asked of the loop (``call_soon(flush_soon)``, at the iteration's end)
  char waiting, flush_due;  // (T_BOOL members)
  PyObject *due, *due_entry, *call_soon, *flush_soon;
  PyTypeObject* window;  // ``post``'s windows: where their slots lie (``attach``)
  Py_ssize_t open, messages_out, seq, waiters;
};

Packet* find(OutboxObject* self, long dst) {
  for (auto& entry : *self->packets)
    if (entry.first == dst) return &entry.second;
  return nullptr;
}

// The arguments every queuing call shares: the destination, channel, sequence number, body.
struct Frame {
  long dst;
  uint64_t tag, seq;
  Py_buffer body;
};

bool frame_args(PyObject* const* args, Frame* f) {
  f->dst = PyLong_AsLong(args[0]);
  f->tag = PyLong_AsUnsignedLongLong(args[1]);
  if (PyErr_Occurred()) return false;
  f->seq = PyLong_AsUnsignedLongLong(args[2]);
  if (PyErr_Occurred()) return false;
  return PyObject_GetBuffer(args[3], &f->body, PyBUF_SIMPLE) == 0;
}

// data(dst, tag, seq, body) -> int: queue message ``seq`` of channel ``tag``: 0 queued in
// the packet waiting, 1 queued as the first of a new packet, -1 not queued: the packet
// is full (the caller sends it and calls again).
long long queue_body(OutboxObject* self, long dst, uint64_t tag, uint64_t seq,
                     const char* body, size_t n) {
  Packet* p = find(self, dst);
  bool started = false;
  if (p == nullptr) {
    self->packets->emplace_back(dst, Packet());
    p = &self->packets->back().second;
    started = true;
  } else {
    size_t size = p->bytes.size();
    bool room = p->frames < self->packet_frames;
    if (p->next >= 0 && static_cast<uint64_t>(p->next) == seq && p->run == tag &&
        static_cast<long long>(size + n) <= self->packet_bytes && room) {
      p->bytes.append(body, n);
      p->frames++;
      p->next = static_cast<long long>(seq) + 1;
      return 0;
    }
    long long at = p->lone;
    if (at >= 0 && static_cast<long long>(size + RUN_MORE_BYTES + n) <= self->packet_bytes &&
        room && get_be64(p->bytes, at + SEQ_AT) + 1 == seq &&
        get_be64(p->bytes, at + TAG_AT) == tag) {  // the second of a run: the lone's head
      p->bytes[at + 1] = static_cast<char>(RUN);  // becomes the run's
      static const char more[RUN_MORE_BYTES] = {static_cast<char>(ARRAY_BYTE), 0, 0, 0, 0};
      p->bytes.insert(at + SMALL_HEAD_BYTES, more, RUN_MORE_BYTES);
      p->bytes.append(body, n);
      p->run = tag;
      p->run_at = static_cast<size_t>(at);
      p->run_from = p->frames - 1;
      p->frames++;
      p->next = static_cast<long long>(seq) + 1;
      p->lone = -1;
      return 0;
    }
    if (static_cast<long long>(size + SMALL_HEAD_BYTES + n) > self->packet_bytes || !room)
      return -1;
    if (p->next >= 0) p->end_run();
  }
  p->lone = static_cast<long long>(p->bytes.size());
  p->add(DATA, tag, seq, body, n);
  return started ? 1 : 0;
}

long long queue_data(OutboxObject* self, const Frame& f) {
  return queue_body(self, f.dst, f.tag, f.seq, static_cast<const char*>(f.body.buf),
                    static_cast<size_t>(f.body.len));
}

// message(dst, tag, seq, obj, room, max_ndim) -> int: ``obj`` encoded as ``encode`` does
// (or, what that leaves, by the Python twin given at construction) and queued as
// ``data`` (its answers), or -2: not a small message (nothing queued).
PyObject* outbox_message(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 6, "message(dst, tag, seq, obj, room, max_ndim)")) return nullptr;
  long dst = PyLong_AsLong(args[0]);
  if (dst == -1 && PyErr_Occurred()) return nullptr;
  uint64_t tag = PyLong_AsUnsignedLongLong(args[1]);
  if (PyErr_Occurred()) return nullptr;
  uint64_t seq = PyLong_AsUnsignedLongLong(args[2]);
  if (PyErr_Occurred()) return nullptr;
  Py_ssize_t room = PyLong_AsSsize_t(args[4]);
  Py_ssize_t max_ndim = PyLong_AsSsize_t(args[5]);
  if (PyErr_Occurred()) return nullptr;
  static std::string body;  // (the GIL is held throughout: one at a time)
  body.clear();
  auto* self = reinterpret_cast<OutboxObject*>(o);
  int done = encode_into(body, args[3], room, max_ndim);
  if (done < 0) return nullptr;
  if (done == 0) {  // the Python twin's, then: ``small.encode``
    if (self->encode == nullptr) {  // (cleared by the collector: not in use)
      PyErr_SetString(PyExc_RuntimeError, "Outbox: cleared");
      return nullptr;
    }
    PyObject* twin = PyObject_Vectorcall(self->encode, args + 3, 3, nullptr);
    if (twin == nullptr) return nullptr;
    if (twin == Py_None) {
      Py_DECREF(twin);
      return PyLong_FromLong(-2);
    }
    char* data;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(twin, &data, &n) < 0) {
      Py_DECREF(twin);
      return nullptr;
    }
    long long got = queue_body(self, dst, tag, seq, data, static_cast<size_t>(n));
    Py_DECREF(twin);
    return PyLong_FromLongLong(got);
  }
  return PyLong_FromLongLong(queue_body(self, dst, tag, seq, body.data(), body.size()));
}

PyObject* one = nullptr;  // (set as the module loads)

PyObject*& slot(PyObject* o, Py_ssize_t offset) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + offset);
}

// Where each of a class's ``__slots__`` ``names`` lies in its objects, into ``offsets``.
bool slot_offsets(PyTypeObject* t, const char* const* names, Py_ssize_t* const* offsets,
                  int n) {
  for (int i = 0; i < n; i++) {
    PyObject* d = PyDict_GetItemString(t->tp_dict, names[i]);  // (borrowed)
    if (d == nullptr || Py_TYPE(d) != &PyMemberDescr_Type ||
        reinterpret_cast<PyMemberDescrObject*>(d)->d_member->type != T_OBJECT_EX) {
      PyErr_Format(PyExc_TypeError, "%s: %s is not a slot", t->tp_name, names[i]);
      return false;
    }
    *offsets[i] = reinterpret_cast<PyMemberDescrObject*>(d)->d_member->offset;
  }
  return true;
}

// The link's flush asked for (``Link._begun``'s commonest case): in ``due``, and of the loop.
bool begun(OutboxObject* self) {
  if (!self->waiting) {
    if (PyList_Append(self->due, self->due_entry) < 0) return false;
    self->waiting = 1;
  }
  if (!self->flush_due) {
    PyObject* handle = PyObject_CallOneArg(self->call_soon, self->flush_soon);
    if (handle == nullptr) return false;
    Py_DECREF(handle);
    self->flush_due = 1;
  }
  return true;
}

// post(window, dst, tag, obj, room, max_ndim, limit) -> int: a channel's small message
// sent through its ``window`` towards ``dst`` (``Channel.send``'s commonest case): where
// the window is open, has fewer than ``limit`` messages out and no sender waits, ``obj``
// queued as ``message`` does, as message ``window.seq``; then the window counts it and the
// link's flush is asked for (``attach``). Returns ``message``'s answer: 0 or 1 queued,
// -1 not queued (the packet is full: the caller sends it and posts again), -2 not a small
// message; or -3: not now (the window's), nothing queued.
PyObject* outbox_post(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 7, "post(window, dst, tag, obj, room, max_ndim, limit)")) return nullptr;
  auto* self = reinterpret_cast<OutboxObject*>(o);
  PyObject* w = args[0];
  if (self->window == nullptr || Py_TYPE(w) != self->window || self->due == nullptr) {
    PyErr_SetString(PyExc_TypeError, "post: not a window, or the outbox not attached");
    return nullptr;
  }
  PyObject *open = slot(w, self->open), *out = slot(w, self->messages_out);
  PyObject *seq = slot(w, self->seq), *waiters = slot(w, self->waiters);
  if (open == nullptr || out == nullptr || seq == nullptr || waiters == nullptr) {
    PyErr_SetString(PyExc_AttributeError, "post: a window's slot is not set");
    return nullptr;
  }
  long long n = PyLong_AsLongLong(out), limit = PyLong_AsLongLong(args[6]);
  if (PyErr_Occurred()) return nullptr;
  Py_ssize_t waiting = PyObject_Length(waiters);
  if (waiting < 0) return nullptr;
  if (open != Py_True || n >= limit || waiting > 0) return PyLong_FromLong(-3);
  PyObject* more = PyLong_FromLongLong(n + 1);
  PyObject* next = more == nullptr ? nullptr : PyNumber_Add(seq, one);
  if (next == nullptr) {
    Py_XDECREF(more);
    return nullptr;
  }
  PyObject* call[6] = {args[1], args[2], seq, args[3], args[4], args[5]};
  Py_INCREF(seq);  // (borrowed from the window, which the encoding's Python twin could touch)
  PyObject* got = outbox_message(o, call, 6);
  Py_DECREF(seq);
  long code = got == nullptr ? -4 : PyLong_AsLong(got);
  if (code < 0) {  // (-1, -2: nothing queued; or an error raised)
    Py_DECREF(more);
    Py_DECREF(next);
    return got;
  }
  Py_SETREF(slot(w, self->messages_out), more);  // (counted: it is queued whatever follows)
  Py_SETREF(slot(w, self->seq), next);
  if (!begun(self)) {
    Py_DECREF(got);
    return nullptr;
  }
  return got;
}

// attach(due, due_entry, call_soon, flush_soon, window): how ``post`` asks for its link's
// flush, and the class of its windows (``__slots__`` open, messages_out, seq and waiters).
PyObject* outbox_attach(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 5, "attach(due, due_entry, call_soon, flush_soon, window)")) return nullptr;
  if (!PyList_CheckExact(args[0]) || !PyType_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError, "attach: due must be a list, window a class");
    return nullptr;
  }
  auto* self = reinterpret_cast<OutboxObject*>(o);
  auto* window = reinterpret_cast<PyTypeObject*>(args[4]);
  const char* names[] = {"open", "messages_out", "seq", "waiters"};
  Py_ssize_t* offsets[] = {&self->open, &self->messages_out, &self->seq, &self->waiters};
  if (!slot_offsets(window, names, offsets, 4)) return nullptr;
  Py_INCREF(window);
  Py_XSETREF(self->window, window);
  PyObject** fields[] = {&self->due, &self->due_entry, &self->call_soon, &self->flush_soon};
  for (int i = 0; i < 4; i++) {
    Py_INCREF(args[i]);
    Py_XSETREF(*fields[i], args[i]);
  }
  Py_RETURN_NONE;
}

PyObject* outbox_data(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 4, "data(dst, tag, seq, body)")) return nullptr;
  Frame f;
  if (!frame_args(args, &f)) return nullptr;
  long long got = queue_data(reinterpret_cast<OutboxObject*>(o), f);
  PyBuffer_Release(&f.body);
  return PyLong_FromLongLong(got);
}

// small(dst, kind, tag, seq, body) -> int: queue a frame of another kind (as ``data``).
PyObject* outbox_small(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 5, "small(dst, kind, tag, seq, body)")) return nullptr;
  long kind = PyLong_AsLong(args[1]);
  if (PyErr_Occurred()) return nullptr;
  if (kind < 0 || kind > 127) {
    PyErr_SetString(PyExc_ValueError, "small: a kind out of range");
    return nullptr;
  }
  PyObject* rest[4] = {args[0], args[2], args[3], args[4]};
  Frame f;
  if (!frame_args(rest, &f)) return nullptr;
  auto* self = reinterpret_cast<OutboxObject*>(o);
  long long got = 0;
  if (kind == DATA) {
    got = queue_data(self, f);
  } else {
    size_t n = static_cast<size_t>(f.body.len);
    Packet* p = find(self, f.dst);
    if (p == nullptr) {
      self->packets->emplace_back(f.dst, Packet());
      p = &self->packets->back().second;
      got = 1;
    } else if (static_cast<long long>(p->bytes.size() + n + SMALL_HEAD_BYTES) >
                   self->packet_bytes ||
               p->frames >= self->packet_frames) {
      got = -1;
    } else {
      if (p->next >= 0) p->end_run();
      p->lone = -1;
    }
    if (got >= 0)
      p->add(static_cast<uint8_t>(kind), f.tag, f.seq, static_cast<const char*>(f.body.buf), n);
  }
  PyBuffer_Release(&f.body);
  return PyLong_FromLongLong(got);
}

// The ``i``th packet, laid out whole (its preamble and head), no longer queued (still
// queued where its bytearray could not be made: an error set).
PyObject* take_at(OutboxObject* self, size_t i) {
  auto& packets = *self->packets;
  Packet& p = packets[i].second;
  if (p.next >= 0) p.end_run();
  std::string& b = p.bytes;
  uint32_t fields[4] = {0, static_cast<uint32_t>(b.size() - PREAMBLE_BYTES), 0, PACKET_FORM};
  for (int k = 0; k < 4; k++) put_u32_le(b, 4 * k, fields[k]);
  b[PREAMBLE_BYTES] = static_cast<char>(ARRAY_BYTE);
  put_be(b, PREAMBLE_BYTES + 1, static_cast<uint64_t>(p.items), 4);
  PyObject* message = PyByteArray_FromStringAndSize(b.data(), static_cast<Py_ssize_t>(b.size()));
  if (message != nullptr) packets.erase(packets.begin() + static_cast<std::ptrdiff_t>(i));
  return message;
}

// take(dst) -> bytearray | None: ``dst``'s packet, laid out whole (its preamble and head), no
// longer queued.
PyObject* outbox_take(PyObject* o, PyObject* arg) {
  auto* self = reinterpret_cast<OutboxObject*>(o);
  long dst = PyLong_AsLong(arg);
  if (dst == -1 && PyErr_Occurred()) return nullptr;
  auto& packets = *self->packets;
  for (size_t i = 0; i < packets.size(); i++)
    if (packets[i].first == dst) return take_at(self, i);
  Py_RETURN_NONE;
}

PyObject* outbox_queued(PyObject* o, PyObject* arg) {
  long dst = PyLong_AsLong(arg);
  if (dst == -1 && PyErr_Occurred()) return nullptr;
  return PyBool_FromLong(find(reinterpret_cast<OutboxObject*>(o), dst) != nullptr);
}

PyObject* outbox_counts(PyObject* o, PyObject* arg) {
  long dst = PyLong_AsLong(arg);
  if (dst == -1 && PyErr_Occurred()) return nullptr;
  Packet* p = find(reinterpret_cast<OutboxObject*>(o), dst);
  if (p == nullptr) Py_RETURN_NONE;
  return Py_BuildValue("(LL)", p->items, p->frames);
}

PyObject* outbox_dsts(PyObject* o, PyObject*) {
  auto& packets = *reinterpret_cast<OutboxObject*>(o)->packets;
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(packets.size()));
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < packets.size(); i++) {
    PyObject* dst = PyLong_FromLong(packets[i].first);
    if (dst == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), dst);
  }
  return out;
}

PyObject* outbox_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  long long packet_bytes = 0;
  PyObject* encode = nullptr;
  static const char* names[] = {"packet_bytes", "encode", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LO", const_cast<char**>(names),
                                   &packet_bytes, &encode))
    return nullptr;
  if (!PyCallable_Check(encode)) {
    PyErr_SetString(PyExc_TypeError, "Outbox: encode must be callable");
    return nullptr;
  }
  auto* self = reinterpret_cast<OutboxObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->packets = new (std::nothrow) std::vector<std::pair<long, Packet>>();
  if (self->packets == nullptr) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  self->packet_bytes = packet_bytes;
  self->packet_frames = 1LL << 61;
  Py_INCREF(encode);
  self->encode = encode;
  return reinterpret_cast<PyObject*>(self);
}

// (``attach`` makes cycles through its link: the collector's to break)
int outbox_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<OutboxObject*>(o);
  Py_VISIT(Py_TYPE(o));
  Py_VISIT(self->encode);
  Py_VISIT(self->due);
  Py_VISIT(self->due_entry);
  Py_VISIT(self->call_soon);
  Py_VISIT(self->flush_soon);
  Py_VISIT(self->window);
  return 0;
}

int outbox_clear(PyObject* o) {
  auto* self = reinterpret_cast<OutboxObject*>(o);
  Py_CLEAR(self->encode);
  Py_CLEAR(self->due);
  Py_CLEAR(self->due_entry);
  Py_CLEAR(self->call_soon);
  Py_CLEAR(self->flush_soon);
  Py_CLEAR(self->window);
  return 0;
}

void outbox_dealloc(PyObject* o) {
  auto* self = reinterpret_cast<OutboxObject*>(o);
  PyObject_GC_UnTrack(o);
  delete self->packets;
  self->packets = nullptr;
  outbox_clear(o);
  PyTypeObject* type = Py_TYPE(o);
  type->tp_free(o);
  Py_DECREF(type);
}

PyMethodDef outbox_methods[] = {
    {"data", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(outbox_data)),
     METH_FASTCALL, "data(dst, tag, seq, body) -> 0 queued, 1 a new packet, -1 full"},
    {"message", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(outbox_message)),
     METH_FASTCALL, "message(dst, tag, seq, obj, room, max_ndim) -> as data, or -2"},
    {"post", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(outbox_post)),
     METH_FASTCALL, "post(window, dst, tag, obj, room, max_ndim, limit) -> as message, or -3"},
    {"attach", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(outbox_attach)),
     METH_FASTCALL, "attach(due, due_entry, call_soon, flush_soon, window): for post"},
    {"small", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(outbox_small)),
     METH_FASTCALL, "small(dst, kind, tag, seq, body) -> as data"},
    {"take", outbox_take, METH_O, "take(dst) -> bytearray | None: the packet, laid out"},
    {"queued", outbox_queued, METH_O, "queued(dst) -> whether a packet waits for dst"},
    {"counts", outbox_counts, METH_O, "counts(dst) -> (items, frames) of its packet | None"},
    {"dsts", outbox_dsts, METH_NOARGS, "dsts() -> the destinations with a packet waiting"},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef outbox_members[] = {
    {"packet_frames", T_LONGLONG, offsetof(OutboxObject, packet_frames), 0,
     "the most frames a packet holds"},
    {"packet_bytes", T_LONGLONG, offsetof(OutboxObject, packet_bytes), READONLY,
     "the most bytes a packet holds"},
    {"waiting", T_BOOL, offsetof(OutboxObject, waiting), 0,
     "whether packets wait (the link's flush is due)"},
    {"flush_due", T_BOOL, offsetof(OutboxObject, flush_due), 0,
     "whether a flush is asked of the loop"},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot outbox_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(outbox_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(outbox_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(outbox_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(outbox_clear)},
    {Py_tp_methods, outbox_methods},
    {Py_tp_members, outbox_members},
    {Py_tp_doc, const_cast<char*>("Outbox(packet_bytes, encode): small frames queued as packets")},
    {0, nullptr}};

PyType_Spec outbox_spec = {"asyncomm_small.Outbox", sizeof(OutboxObject), 0,
                           Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, outbox_slots};

// -- the lane: a polled link's small messages on their hot path --------------------------
//
// What a channel's ``recv`` does before it parks, where the link polls a receive kept
// posted (MPI's ``PostedLink``), in one call (``look``): the router's flush
// (``Router.flush(waiting=True)``: the credit owed, then the packets queued, sent), the
// loop's fairness (``Hurry.allowed``), then the receive tested and each packet that came
// read and handed to the delivery (``Delivery.messages``), until the mailbox holds what the
// receiver wants or the look's budget is spent (``Hurry.run``). Each of these is a Python
// call of its own otherwise (a ping-pong leg's every message). The rules stay theirs: the
// credit owed is paid by the router's own code, other links' work due by ``run_due``,
// requests in flight are tested by the poller's ``sweep`` (which calls the probe), and
// wherever the state is not the commonest (frames held behind a large one, a batch of
// envelopes pending, the link closed) ``look`` says so before it does anything, and the
// Python path runs instead. The transport's calls come from its compiled module
// (``LaneCalls``, a capsule); the Python objects' state is read where the Python code
// keeps it: the Window's and Hurry's slots, and the containers their owners hand over
// (``Poller.lane``, ``Router.owed``, the link's held frames and batches).

struct LaneCalls {  // (the layout of mpi.cpp's: ``version`` 1)
  int version;
  int (*send)(uint64_t comm, const char* buf, Py_ssize_t len, int dst, int tag,
              uint64_t* pending);
  int (*test)(uint64_t request, int* done, int* source, int* count);
  int (*start)(uint64_t request);
};

constexpr double FAIR_S = 1e-3;  // hurry.FAIR_S (the module's FAIR_S: a test compares them)

double clock_now() {  // time.perf_counter's clock (Linux: CLOCK_MONOTONIC)
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct LaneObject {
  PyObject_HEAD
  OutboxObject* outbox;
  const LaneCalls* calls;
  uint64_t comm, request;  // the link's communicator and its persistent receive
  int tag;                 // the link messages' tag
  long max_ndim;
  PyObject *slot;          // the receive's bytearray
  PyObject *deliver;       // Delivery.messages(src, items)
  PyObject *message_type;  // what a message is made (a tuple type)
  PyObject *settle;        // link._settle(dst, packet, pending, code): a send not done at once
  PyObject *other;         // link._other(src, count, code): not a packet, or a failed receive
  PyObject *slow;          // link.pump: the Python path, while frames are held or it closed
  PyObject *pay;           // router.pay_held(): the credit owed, as a waiting task pays it
  PyObject *sweep;         // the poller's sweep: what looks while requests are in flight
  // Their owners' state, kept (changed in place, never replaced): dicts of the frames held
  // behind a large one, the envelopes batched, the credit owed; lists of the poller's
  // probes, requests in flight and requests issued this iteration
  PyObject *held, *batches, *owed, *probes, *requests, *fresh;
  char stopped;            // whether the link stopped (``stop``)
  PyObject *hurry;         // the poller's Hurry: where its slots lie, below
  Py_ssize_t tests, budget_s, since, turn, refused;
  PyObject *turned, *call_soon, *run_due, *loop;  // (``turned``: the Hurry's)
  PyObject* observe;       // None, or called with each packet's destination as it is sent
};

// The truth of a call's answer (stolen), or -1 where it raised.
int truth_of(PyObject* answer) {
  if (answer == nullptr) return -1;
  int truth = PyObject_IsTrue(answer);
  Py_DECREF(answer);
  return truth;
}

// Whether ``look`` may go on: no frames held behind a large one, no batch of envelopes
// pending, the link not stopped.
bool commonest(LaneObject* self) {
  return !self->stopped && PyDict_GET_SIZE(self->held) == 0 &&
         PyDict_GET_SIZE(self->batches) == 0;
}

// Whether the link's probe alone may look (``Poller.hurry_until``'s commonest: one probe,
// no request in flight); if not, the poller's ``sweep`` looks.
bool alone(LaneObject* self) {
  return PyList_GET_SIZE(self->probes) == 1 && PyList_GET_SIZE(self->requests) == 0 &&
         PyList_GET_SIZE(self->fresh) == 0;
}

// Send every packet queued (``MpiLink._send_packets``); false on an error raised.
bool send_packets(LaneObject* self) {
  auto& packets = *self->outbox->packets;
  while (!packets.empty()) {
    long dst = packets.front().first;
    PyObject* packet = take_at(self->outbox, 0);
    if (packet == nullptr) return false;
    uint64_t pending = 0;
    int code = self->calls->send(self->comm, PyByteArray_AS_STRING(packet),
                                 PyByteArray_GET_SIZE(packet), static_cast<int>(dst),
                                 self->tag, &pending);
    if (self->observe != nullptr && self->observe != Py_None) {
      PyObject* seen = PyObject_CallFunction(self->observe, "l", dst);
      Py_XDECREF(seen);
      if (seen == nullptr) {
        Py_DECREF(packet);
        return false;
      }
    }
    if (code != 0 || pending != 0) {  // (rare: the link makes its handle)
      PyObject* settled = PyObject_CallFunction(self->settle, "lOKi", dst, packet,
                                                static_cast<unsigned long long>(pending), code);
      Py_XDECREF(settled);
      if (settled == nullptr) {
        Py_DECREF(packet);
        return false;
      }
    }
    Py_DECREF(packet);
  }
  return true;
}

// ``Router.flush(waiting=True)``'s commonest case: the credit owed paid as a waiting task
// pays it (``pay``, where any is owed), this link's flush no longer due, its packets sent.
bool flush(LaneObject* self) {
  if (PyDict_GET_SIZE(self->owed) > 0) {
    PyObject* paid = PyObject_CallNoArgs(self->pay);
    if (paid == nullptr) return false;
    Py_DECREF(paid);
  }
  OutboxObject* box = self->outbox;
  if (box->waiting) {
    box->waiting = 0;
    Py_ssize_t n = PyList_GET_SIZE(box->due);
    for (Py_ssize_t i = 0; i < n; i++) {
      if (PyList_GET_ITEM(box->due, i) == box->due_entry) {
        if (PyList_SetSlice(box->due, i, i + 1, nullptr) < 0) return false;
        break;
      }
    }
  }
  return send_packets(self);
}

// Whether the lane may be used (not cleared by the collector); if not, an error is set.
bool usable(LaneObject* self) {
  if (self->outbox != nullptr && self->outbox->due != nullptr && self->held != nullptr &&
      self->hurry != nullptr)
    return true;
  PyErr_SetString(PyExc_RuntimeError, "Lane: cleared");
  return false;
}

// ``PostedLink.pump`` (the poller's probe, and each test of a look): 1 a message came
// (taken), 0 none, -1 an error raised.
int pump_once(LaneObject* self) {
  if (self->stopped || PyDict_GET_SIZE(self->held) > 0)
    return truth_of(PyObject_CallNoArgs(self->slow));
  int done = 0, source = -1, count = 0;
  int code = self->calls->test(self->request, &done, &source, &count);
  if (code == 0 && !done) return 0;
  PyObject *items = nullptr, *src = nullptr;
  if (code == 0) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(PyByteArray_AS_STRING(self->slot));
    Py_ssize_t size = PyByteArray_GET_SIZE(self->slot);
    if (count >= 16 && count <= size) {
      uint32_t field[4];
      for (int i = 0; i < 4; i++)
        field[i] = p[4 * i] | (p[4 * i + 1] << 8) | (p[4 * i + 2] << 16) |
                   (static_cast<uint32_t>(p[4 * i + 3]) << 24);
      if (field[0] == 0 && field[2] == 0 && field[3] == 1 &&
          field[1] <= static_cast<uint32_t>(count) - 16) {
        src = PyLong_FromLong(source);
        if (src == nullptr) return -1;
        items = read_packet(p + 16, field[1], self->max_ndim,
                            reinterpret_cast<PyTypeObject*>(self->message_type), src);
      }
    }
  }
  if (items == nullptr) {  // not a packet (or one the Python twin reads), or a failure
    Py_XDECREF(src);
    PyObject* taken = PyObject_CallFunction(self->other, "iii", source, count, code);
    Py_XDECREF(taken);
    return taken == nullptr ? -1 : 1;
  }
  code = self->calls->start(self->request);  // (read: the receive goes on at once)
  PyObject* argv[2] = {src, items};
  PyObject* delivered = PyObject_Vectorcall(self->deliver, argv, 2, nullptr);
  Py_DECREF(src);
  Py_DECREF(items);
  Py_XDECREF(delivered);
  if (delivered == nullptr) return -1;
  if (code != 0) {  // (not seen: the receive completed above)
    PyObject* failed = PyObject_CallFunction(self->other, "iii", source, -1, code);
    Py_XDECREF(failed);
    if (failed == nullptr) return -1;
  }
  return 1;
}

// Whether ``frames`` (a mailbox's deque) holds a message from ``src`` (None: any), or
// where ``frames`` is callable, whether it returns true; -1 an error raised.
int holds(PyObject* frames, PyObject* src) {
  if (PyCallable_Check(frames)) return truth_of(PyObject_CallNoArgs(frames));
  Py_ssize_t n = PyObject_Length(frames);
  if (n <= 0 || src == Py_None) return n < 0 ? -1 : n > 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* entry = PySequence_GetItem(frames, i);
    if (entry == nullptr) return -1;
    PyObject* from = PyTuple_Check(entry) ? PyTuple_GET_ITEM(entry, 0) : nullptr;
    if (from != nullptr) Py_INCREF(from);
    else from = PyObject_GetAttrString(entry, "src");
    Py_DECREF(entry);
    if (from == nullptr) return -1;
    int same = PyObject_RichCompareBool(from, src, Py_EQ);
    Py_DECREF(from);
    if (same != 0) return same;
  }
  return 0;
}

bool set_float(PyObject* o, Py_ssize_t offset, double value) {
  PyObject* f = PyFloat_FromDouble(value);
  if (f == nullptr) return false;
  Py_XSETREF(slot(o, offset), f);
  return true;
}

// ``Hurry.allowed`` (this link's flush done already): -1 an error raised.
int allowed(LaneObject* self, long tests) {
  if (tests <= 0) return 0;
  if (PyList_GET_SIZE(self->outbox->due) > 0) {  // other links' work goes first
    PyObject* ran = PyObject_CallOneArg(self->run_due, self->loop);
    Py_XDECREF(ran);
    if (ran == nullptr) return -1;
  }
  PyObject* h = self->hurry;
  double turn = PyFloat_AsDouble(slot(h, self->turn));
  if (turn == -1.0 && PyErr_Occurred()) return -1;
  double now = clock_now();
  if (turn == 0.0) {
    if (!set_float(h, self->turn, now)) return -1;
    PyObject* handle = PyObject_CallOneArg(self->call_soon, self->turned);
    Py_XDECREF(handle);
    return handle == nullptr ? -1 : 1;
  }
  return now - turn <= FAIR_S;
}

// look(frames, src) -> int: see the note. 1: ``frames`` holds a message from ``src`` (None:
// any), or ``frames()`` is true where it is callable (an actor's: a future's ``done``);
// 0: not (the look's budget spent, or refused until the loop turns: the Hurry's
// ``refused``); -1: nothing done, the Python path's to do.
PyObject* lane_look(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "look(frames, src)")) return nullptr;
  auto* self = reinterpret_cast<LaneObject*>(o);
  if (!usable(self)) return nullptr;
  PyObject *frames = args[0], *src = args[1], *h = self->hurry;
  if (!commonest(self)) return PyLong_FromLong(-1);
  if (!flush(self)) return nullptr;
  long tests = PyLong_AsLong(slot(h, self->tests));
  if (tests == -1 && PyErr_Occurred()) return nullptr;
  int may = allowed(self, tests);
  if (may < 0) return nullptr;
  Py_INCREF(may || tests <= 0 ? Py_False : Py_True);
  Py_XSETREF(slot(h, self->refused), may || tests <= 0 ? Py_False : Py_True);
  if (!may) return PyLong_FromLong(0);
  double start = clock_now();
  double budget = PyFloat_AsDouble(slot(h, self->budget_s));
  if (budget == -1.0 && PyErr_Occurred()) return nullptr;
  bool probe = alone(self);  // (else the poller's sweep: requests are in flight)
  for (long i = 0; i < tests || (budget > 0 && clock_now() < start + budget); i++) {
    int found = probe ? pump_once(self) : truth_of(PyObject_CallNoArgs(self->sweep));
    if (found < 0) return nullptr;
    if (!found) continue;
    int there = holds(frames, src);
    if (there != 0) return there < 0 ? nullptr : PyLong_FromLong(1);
    if (!commonest(self)) return PyLong_FromLong(-1);  // (what came held frames, or closed)
    probe = alone(self);  // (... or begun receives: the sweep looks from now on)
  }
  if (!set_float(h, self->since, start)) return nullptr;
  return PyLong_FromLong(0);
}

PyObject* lane_pump(PyObject* o, PyObject*) {
  if (!usable(reinterpret_cast<LaneObject*>(o))) return nullptr;
  int found = pump_once(reinterpret_cast<LaneObject*>(o));
  if (found < 0) return nullptr;
  return PyBool_FromLong(found);
}

PyObject* lane_flush(PyObject* o, PyObject*) {
  if (!usable(reinterpret_cast<LaneObject*>(o))) return nullptr;
  if (!send_packets(reinterpret_cast<LaneObject*>(o))) return nullptr;
  Py_RETURN_NONE;
}

PyObject* lane_stop(PyObject* o, PyObject*) {
  reinterpret_cast<LaneObject*>(o)->stopped = 1;
  Py_RETURN_NONE;
}

PyObject* lane_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *outbox, *capsule, *comm, *request, *slot_, *deliver, *message_type, *settle,
      *other, *slow, *pay, *sweep, *held, *batches, *owed, *probes, *requests, *fresh, *h,
      *call_soon, *run_due, *loop;
  int tag;
  long max_ndim;
  if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) > 0) {
    PyErr_SetString(PyExc_TypeError, "Lane: positional arguments only");
    return nullptr;
  }
  if (!PyArg_ParseTuple(args, "OOOOiOOOlOOOOOOOOOOOOOOO", &outbox, &capsule, &comm,
                        &request, &tag, &slot_, &deliver, &message_type, &max_ndim, &settle,
                        &other, &slow, &pay, &sweep, &held, &batches, &owed, &probes,
                        &requests, &fresh, &h, &call_soon, &run_due, &loop))
    return nullptr;
  auto* calls = static_cast<const LaneCalls*>(PyCapsule_GetPointer(capsule, "asyncomm.lane_calls"));
  if (calls == nullptr) return nullptr;
  if (calls->version != 1 || !PyByteArray_CheckExact(slot_) || !PyType_Check(message_type) ||
      strcmp(Py_TYPE(outbox)->tp_name, "asyncomm_small.Outbox") != 0 ||
      reinterpret_cast<OutboxObject*>(outbox)->due == nullptr || !PyDict_CheckExact(held) ||
      !PyDict_CheckExact(batches) || !PyDict_CheckExact(owed) || !PyList_CheckExact(probes) ||
      !PyList_CheckExact(requests) || !PyList_CheckExact(fresh)) {
    PyErr_SetString(PyExc_TypeError, "Lane: calls of another version, or an argument of the "
                                     "wrong kind (an attached Outbox, a bytearray, the dicts "
                                     "and lists of its owners)");
    return nullptr;
  }
  uint64_t comm_bits = PyLong_AsUnsignedLongLongMask(comm);
  uint64_t request_bits = PyLong_AsUnsignedLongLongMask(request);
  if (PyErr_Occurred()) return nullptr;
  const char* names[] = {"tests", "budget_s", "_since", "_turn", "refused"};
  Py_ssize_t offsets[5];
  Py_ssize_t* into[] = {&offsets[0], &offsets[1], &offsets[2], &offsets[3], &offsets[4]};
  if (!slot_offsets(Py_TYPE(h), names, into, 5)) return nullptr;
  PyObject* turned = PyObject_GetAttrString(h, "turned");
  if (turned == nullptr) return nullptr;
  auto* self = reinterpret_cast<LaneObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) {
    Py_DECREF(turned);
    return nullptr;
  }
  self->turned = turned;
  self->tests = offsets[0];
  self->budget_s = offsets[1];
  self->since = offsets[2];
  self->turn = offsets[3];
  self->refused = offsets[4];
  self->calls = calls;
  self->comm = comm_bits;
  self->request = request_bits;
  self->tag = tag;
  self->max_ndim = max_ndim;
  Py_INCREF(outbox);
  self->outbox = reinterpret_cast<OutboxObject*>(outbox);
  PyObject** kept[] = {&self->slot,    &self->deliver,  &self->message_type, &self->settle,
                       &self->other,   &self->slow,     &self->pay,          &self->sweep,
                       &self->held,    &self->batches,  &self->owed,         &self->probes,
                       &self->requests, &self->fresh,   &self->hurry,        &self->call_soon,
                       &self->run_due, &self->loop};
  PyObject* given[] = {slot_, deliver, message_type, settle,   other, slow,      pay,
                       sweep, held,    batches,      owed,     probes, requests, fresh,
                       h,     call_soon, run_due,   loop};
  for (int i = 0; i < 18; i++) {
    Py_INCREF(given[i]);
    *kept[i] = given[i];
  }
  return reinterpret_cast<PyObject*>(self);
}

int lane_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<LaneObject*>(o);
  Py_VISIT(Py_TYPE(o));
  Py_VISIT(reinterpret_cast<PyObject*>(self->outbox));
  PyObject* refs[] = {self->slot,     self->deliver, self->message_type, self->settle,
                      self->other,    self->slow,    self->pay,          self->sweep,
                      self->held,     self->batches, self->owed,         self->probes,
                      self->requests, self->fresh,   self->hurry,        self->turned,
                      self->call_soon, self->run_due, self->loop,        self->observe};
  for (PyObject* r : refs) Py_VISIT(r);
  return 0;
}

int lane_clear(PyObject* o) {
  auto* self = reinterpret_cast<LaneObject*>(o);
  PyObject** refs[] = {&self->slot,     &self->deliver, &self->message_type, &self->settle,
                       &self->other,    &self->slow,    &self->pay,          &self->sweep,
                       &self->held,     &self->batches, &self->owed,         &self->probes,
                       &self->requests, &self->fresh,   &self->hurry,        &self->turned,
                       &self->call_soon, &self->run_due, &self->loop,        &self->observe};
  for (PyObject** r : refs) Py_CLEAR(*r);
  Py_CLEAR(self->outbox);
  return 0;
}

void lane_dealloc(PyObject* o) {
  PyObject_GC_UnTrack(o);
  lane_clear(o);
  PyTypeObject* type = Py_TYPE(o);
  type->tp_free(o);
  Py_DECREF(type);
}

PyMethodDef lane_methods[] = {
    {"look", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(lane_look)),
     METH_FASTCALL, "look(frames, src) -> 1 there, 0 not (looked or refused), -1 Python's"},
    {"pump", lane_pump, METH_NOARGS, "pump() -> whether a message came (the poller's probe)"},
    {"flush", lane_flush, METH_NOARGS, "flush(): send every packet queued"},
    {"stop", lane_stop, METH_NOARGS, "stop(): the link stopped (pump and look: Python's)"},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef lane_members[] = {
    {"observe", T_OBJECT, offsetof(LaneObject, observe), 0,
     "None, or called with each packet's destination as it is sent (for tests)"},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot lane_slots[] = {
    {Py_tp_members, lane_members},
    {Py_tp_new, reinterpret_cast<void*>(lane_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(lane_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(lane_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(lane_clear)},
    {Py_tp_methods, lane_methods},
    {Py_tp_doc, const_cast<char*>("Lane(...): a polled link's small messages on their hot path")},
    {0, nullptr}};

PyType_Spec lane_spec = {"asyncomm_small.Lane", sizeof(LaneObject), 0,
                         Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, lane_slots};

// A collected type's dealloc: untracked, cleared (``clear``: its references), freed, and its
// (heap) type let go.
template <int (*clear)(PyObject*)>
void gc_dealloc(PyObject* o) {
  PyObject_GC_UnTrack(o);
  clear(o);
  PyTypeObject* type = Py_TYPE(o);
  type->tp_free(o);
  Py_DECREF(type);
}

// -- receiving: a channel's recv, where what it wants is there -----------------------------
//
// ``Channel.recv`` returns a coroutine. Most of its calls find their message in the
// mailbox already (a burst's), or have the link's look find it (a ping-pong's): for those a
// Python coroutine's frame is most of the cost (about 1 µs of 1.5 a message). ``Receiver``
// (one per channel) makes ``Step`` objects instead: coroutines as asyncio takes them
// (``send``, ``throw``, ``close``, ``__await__``: ``asyncio.iscoroutine`` says so, a task
// runs one) that do nothing until first sent to, as a coroutine does (a receive never
// awaited, or cancelled before it ran, takes nothing). Sent to, one takes the commonest
// case as ``Channel._receive`` does: the mailbox's first entry a small message (from
// ``src``), taken and counted for credit (``Channel._took``'s commonest, inline; the rest by
// ``took``); else, the mailbox empty, the link's look, then that again. Any other case (a
// bad ``src`` or timeout, a traced channel while recording, a frame not the commonest, the
// look's budget spent or refused, no look) it hands to the Python coroutine that does it
// (``_receive``, or ``_wait`` after a look that found nothing), and passes everything on to
// that coroutine from then on. The rules stay ``Channel``'s: this takes only what its
// Python twin takes first, in the same order.

struct ReceiverObject {
  PyObject_HEAD
  PyObject *frames, *taken;  // the mailbox's (changed in place, never replaced)
  PyObject *message_type;    // Message (exactly: a small message's)
  PyObject *probe;           // None, or a traced channel's Probe (its ``recording`` read)
  PyObject *look;            // the link's look, or None
  PyObject *took;            // channel._took(message) -> message: credit, the Python path
  PyObject *receive;         // channel._receive(src, timeout, looked): the Python coroutine
  PyObject *wait;            // channel._wait(src, limit, looked): the same, after a look
  PyObject *timeout;         // the channel's default (a float)
  long long batch_less_one;  // messages taken before credit goes back, less one
  long long size;            // the ranks
  char small;                // whether the channel's messages may be small ones
};

// A coroutine whose commonest case is compiled (a receive's, an actor call's): ``first``
// runs when it is first sent to, and either gives its result or the Python coroutine it
// hands over to.
struct StepObject;
using First = PyObject* (*)(StepObject* self, PyObject** inner);
constexpr int STEP_ARGS = 6;

struct StepObject {
  PyObject_HEAD
  PyObject* owner;             // what made it (a Receiver, a Caller)
  PyObject* arg[STEP_ARGS];    // its call's arguments (nullptr beyond ``nargs``)
  Py_ssize_t nargs;
  First first;
  PyObject* inner;  // the Python coroutine handed to, once handed to
  int state;        // FRESH, HANDED (to ``inner``), DONE
};

enum { FRESH = 0, HANDED = 1, DONE = 2 };

PyObject* str_popleft = nullptr;  // (set as the module loads)
PyObject* str_items = nullptr;
PyObject* str_waiter = nullptr;
PyObject* str_append = nullptr;
PyObject* str_done = nullptr;
PyObject* str_set_result = nullptr;
PyObject* str_recording = nullptr;
PyObject* str_throw = nullptr;
PyObject* str_close = nullptr;

// Count ``message`` (from ``from``) as taken, as ``Channel._took`` does: 0, or -1 an error.
int count_taken(PyObject* taken, PyObject* from, long long batch_less_one, PyObject* took,
                PyObject* message) {
  PyObject* done = PyDict_GetItemWithError(taken, from);  // (borrowed)
  if (done == nullptr && PyErr_Occurred()) return -1;
  if (done != nullptr && PyList_CheckExact(done) && PyList_GET_SIZE(done) >= 1 &&
      PyLong_CheckExact(PyList_GET_ITEM(done, 0))) {
    long long count = PyLong_AsLongLong(PyList_GET_ITEM(done, 0));
    if (count == -1 && PyErr_Occurred()) return -1;
    if (count < batch_less_one) {
      PyObject* more = PyLong_FromLongLong(count + 1);
      if (more == nullptr) return -1;
      PyList_SetItem(done, 0, more);  // (steals ``more``)
      return 0;
    }
  }
  PyObject* answer = PyObject_CallOneArg(took, message);  // credit goes back: the router's
  Py_XDECREF(answer);
  return answer == nullptr ? -1 : 0;
}

// The mailbox's first entry taken, where it is the commonest (a small message, from ``src``
// unless None): 1 and the message in ``*out``; 0 the mailbox empty; 2 not the commonest
// (Python's); -1 an error raised.
int take_first(ReceiverObject* r, PyObject* src, PyObject** out) {
  Py_ssize_t n = PyObject_Length(r->frames);
  if (n <= 0) return n < 0 ? -1 : 0;
  PyObject* first = PySequence_GetItem(r->frames, 0);
  if (first == nullptr) return -1;
  if (Py_TYPE(first) != reinterpret_cast<PyTypeObject*>(r->message_type) ||
      PyTuple_GET_SIZE(first) != 3) {
    Py_DECREF(first);
    return 2;
  }
  PyObject* from = PyTuple_GET_ITEM(first, 0);
  if (src != Py_None) {
    int same = PyObject_RichCompareBool(from, src, Py_EQ);
    if (same <= 0) {
      Py_DECREF(first);
      return same < 0 ? -1 : 2;
    }
  }
  PyObject* popped = PyObject_CallMethodNoArgs(r->frames, str_popleft);
  if (popped == nullptr) {
    Py_DECREF(first);
    return -1;
  }
  Py_DECREF(popped);  // (``first``: the same)
  if (count_taken(r->taken, from, r->batch_less_one, r->took, first) < 0) {
    Py_DECREF(first);
    return -1;
  }
  *out = first;
  return 1;
}

// What a fresh receive's Step does when first sent to: a message (new reference, the result), or
// nullptr with ``*inner`` set to the coroutine it hands over to (nullptr too: an error).
PyObject* receive_first(StepObject* self, PyObject** inner) {
  auto* r = reinterpret_cast<ReceiverObject*>(self->owner);
  PyObject *src = self->arg[0], *timeout = self->arg[1], *message = nullptr;
  *inner = nullptr;
  bool commonest = r->small;
  if (commonest && src != Py_None) {  // (a bad src: the Python path raises its error)
    if (!PyLong_CheckExact(src)) {
      commonest = false;
    } else {
      long long s = PyLong_AsLongLong(src);
      if (s == -1 && PyErr_Occurred()) PyErr_Clear();
      commonest = s >= 0 && s < r->size;
    }
  }
  if (commonest && r->probe != Py_None) {  // a traced channel: not while recording
    PyObject* recording = PyObject_GetAttr(r->probe, str_recording);
    if (recording == nullptr) return nullptr;
    commonest = recording == Py_None;
    Py_DECREF(recording);
  }
  int looked = 0;
  if (commonest) {
    int got = take_first(r, src, &message);
    if (got == 1) return message;
    if (got < 0) return nullptr;
    if (got == 0 && r->look != Py_None) {  // empty: the link's look (``recv``'s, the same)
      PyObject* limit = timeout == Py_None ? r->timeout : timeout;
      double seconds = PyFloat_AsDouble(limit);
      if (seconds == -1.0 && PyErr_Occurred()) PyErr_Clear();  // (Python's to refuse)
      else if (seconds > 0) {
        PyObject* args[] = {r->frames, src};
        PyObject* answer = PyObject_Vectorcall(r->look, args, 2, nullptr);
        if (answer == nullptr) return nullptr;
        long found = PyLong_AsLong(answer);
        Py_DECREF(answer);
        if (found == -1 && PyErr_Occurred()) return nullptr;
        if (found > 0) {
          got = take_first(r, src, &message);
          if (got == 1) return message;
          if (got < 0) return nullptr;
          looked = 1;  // (what came is not the commonest: Python's, having looked)
        } else if (found == 0) {  // looked, nothing: ``_wait`` (having looked)
          PyObject* wait_args[] = {src, limit, Py_True};
          *inner = PyObject_Vectorcall(r->wait, wait_args, 3, nullptr);
          return nullptr;
        }
      }
    }
  }
  PyObject* args[] = {src, timeout, looked ? Py_True : Py_False};
  *inner = PyObject_Vectorcall(r->receive, args, 3, nullptr);
  return nullptr;
}

void step_done(StepObject* self) {
  self->state = DONE;
  Py_CLEAR(self->inner);
}

PySendResult step_send(PyObject* o, PyObject* arg, PyObject** result) {
  auto* self = reinterpret_cast<StepObject*>(o);
  *result = nullptr;
  if (self->state == DONE) {
    PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
    return PYGEN_ERROR;
  }
  if (self->state == FRESH) {
    if (arg != Py_None) {
      self->state = DONE;
      PyErr_SetString(PyExc_TypeError, "can't send non-None value to a just-started coroutine");
      return PYGEN_ERROR;
    }
    PyObject* inner = nullptr;
    PyObject* message = self->first(self, &inner);
    if (message != nullptr) {
      self->state = DONE;
      *result = message;
      return PYGEN_RETURN;
    }
    if (inner == nullptr) {
      self->state = DONE;
      return PYGEN_ERROR;
    }
    self->inner = inner;
    self->state = HANDED;
  }
  PySendResult sent = PyIter_Send(self->inner, arg, result);
  if (sent != PYGEN_NEXT) step_done(self);
  return sent;
}

// The Python protocol's face of ``step_send``: a value yielded, or nullptr with
// StopIteration(value) set (or the error).
PyObject* step_step(PyObject* o, PyObject* arg) {
  PyObject* result;
  PySendResult sent = step_send(o, arg, &result);
  if (sent == PYGEN_NEXT) return result;
  if (sent == PYGEN_RETURN) {
    // (the value wrapped: a Message is a tuple, which StopIteration would take as its args)
    PyObject* stop = PyObject_CallOneArg(PyExc_StopIteration, result);
    Py_DECREF(result);
    if (stop != nullptr) {
      PyErr_SetObject(PyExc_StopIteration, stop);
      Py_DECREF(stop);
    }
  }
  return nullptr;
}

PyObject* step_next(PyObject* o) { return step_step(o, Py_None); }

PyObject* step_throw(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<StepObject*>(o);
  if (nargs < 1 || nargs > 3) {
    PyErr_SetString(PyExc_TypeError, "throw(value) or throw(type[, value[, traceback]])");
    return nullptr;
  }
  if (self->state == HANDED) {  // the coroutine it handed to meets it
    PyObject* inner = self->inner;
    Py_INCREF(inner);
    PyObject* call[] = {inner, args[0], nargs > 1 ? args[1] : Py_None,
                        nargs > 2 ? args[2] : Py_None};
    PyObject* result = PyObject_VectorcallMethod(str_throw, call,
                                                 static_cast<size_t>(nargs) + 1, nullptr);
    Py_DECREF(inner);
    if (result == nullptr) step_done(self);
    return result;
  }
  self->state = DONE;  // not started (or over): raised here, as a coroutine raises it
  PyObject* kind = args[0];
  if (PyExceptionInstance_Check(kind)) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(kind)), kind);
  } else if (PyExceptionClass_Check(kind)) {
    PyErr_SetObject(kind, nargs > 1 ? args[1] : Py_None);
  } else {
    PyErr_SetString(PyExc_TypeError, "exceptions must be classes or instances deriving from "
                                     "BaseException");
  }
  return nullptr;
}

PyObject* step_close(PyObject* o, PyObject*) {
  auto* self = reinterpret_cast<StepObject*>(o);
  PyObject* inner = self->inner;
  Py_XINCREF(inner);
  step_done(self);
  if (inner == nullptr) Py_RETURN_NONE;
  PyObject* result = PyObject_CallMethodNoArgs(inner, str_close);
  Py_DECREF(inner);
  return result;
}

PyObject* step_await(PyObject* o) {
  Py_INCREF(o);
  return o;
}

int step_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<StepObject*>(o);
  Py_VISIT(Py_TYPE(o));
  Py_VISIT(self->owner);
  for (Py_ssize_t i = 0; i < self->nargs; i++) Py_VISIT(self->arg[i]);
  Py_VISIT(self->inner);
  return 0;
}

int step_clear(PyObject* o) {
  auto* self = reinterpret_cast<StepObject*>(o);
  Py_CLEAR(self->owner);
  for (Py_ssize_t i = 0; i < self->nargs; i++) Py_CLEAR(self->arg[i]);
  Py_CLEAR(self->inner);
  return 0;
}

PyMethodDef step_methods[] = {
    {"send", step_step, METH_O, "send(value): the coroutine's next step"},
    {"throw", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(step_throw)),
     METH_FASTCALL, "throw(value) or throw(type[, value[, traceback]])"},
    {"close", step_close, METH_NOARGS, "close(): the coroutine ends"},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot step_slots[] = {
    {Py_am_await, reinterpret_cast<void*>(step_await)},
    {Py_am_send, reinterpret_cast<void*>(step_send)},
    {Py_tp_iter, reinterpret_cast<void*>(step_await)},
    {Py_tp_iternext, reinterpret_cast<void*>(step_next)},
    {Py_tp_methods, step_methods},
    {Py_tp_dealloc, reinterpret_cast<void*>(gc_dealloc<step_clear>)},
    {Py_tp_traverse, reinterpret_cast<void*>(step_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(step_clear)},
    {Py_tp_doc, const_cast<char*>("A coroutine whose commonest case is compiled (see "
                                  "Receiver, Caller)")},
    {0, nullptr}};

PyType_Spec step_spec = {"asyncomm_small.Step", sizeof(StepObject), 0,
                              Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, step_slots};

PyTypeObject* step_type = nullptr;  // (set as the module loads)

// A fresh Step of ``owner``'s, of the call ``args``, that runs ``first`` when first sent to.
PyObject* make_step(PyObject* owner, First first, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = PyObject_GC_New(StepObject, step_type);  // (it holds its type)
  if (self == nullptr) return nullptr;
  Py_INCREF(owner);
  self->owner = owner;
  for (Py_ssize_t i = 0; i < STEP_ARGS; i++) {
    self->arg[i] = i < nargs ? args[i] : nullptr;
    Py_XINCREF(self->arg[i]);
  }
  self->nargs = nargs;
  self->first = first;
  self->inner = nullptr;
  self->state = FRESH;
  PyObject_GC_Track(self);
  return reinterpret_cast<PyObject*>(self);
}

// receive(src, timeout) -> Step: the coroutine of one recv.
PyObject* receiver_receive(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "receive(src, timeout)")) return nullptr;
  return make_step(o, receive_first, args, nargs);
}

// -- calling: an actor call, where its answer comes while it looks -----------------------
//
// ``Host._call`` (actors) in compiled form for its commonest case: the callee not known
// gone or closed, the request posted (or queued behind others to that rank), the link's
// look, and the answer found by it (a ping-pong of calls): no Python coroutine made. A
// call whose answer does not come while it looks hands over to ``Host._finish`` (the
// wait, its deadline, the callee's failure); a callee known gone or closed, or a rank not
// an int, to ``Host._call`` itself, which says why. The rules stay ``Host``'s: this does
// what ``_call`` does first, in the same order.

struct CallerObject {
  PyObject_HEAD
  PyObject *dead, *ended, *replies_ended;  // ranks gone, or that closed (sets)
  PyObject *ids;            // the call ids (itertools.count)
  PyObject *create_future;  // the loop's
  PyObject *calls;          // the calls in flight, by id: (rank, future, name, method)
  PyObject *backlog;        // requests queued per rank (a rank with any queues the next)
  PyObject *post;           // the requests channel's posting(request, rank) -> bool
  PyObject *queue;          // Host._queue(rank, channel, request)
  PyObject *requests;       // the requests channel
  PyObject *look;           // the link's look, or None
  PyObject *router_expect, *link_expect, *hurry;  // as ``_call`` calls them
  PyObject *full;           // Host._call: the Python coroutine, whole
  PyObject *finish;         // Host._finish: the wait for an answer not found by looking
  PyObject *result;         // Host._result(rank, name, method, ok, result): raises if not ok
};

PyObject* str_result = nullptr;  // (set as the module loads)

PyObject* call_first(StepObject* self, PyObject** inner) {
  auto* c = reinterpret_cast<CallerObject*>(self->owner);
  PyObject *rank = self->arg[0], *name = self->arg[1], *method = self->arg[2],
           *args = self->arg[3], *kwargs = self->arg[4], *timeout = self->arg[5];
  *inner = nullptr;
  int known = PyLong_CheckExact(rank) && PyTuple_CheckExact(args) ? 0 : 1;
  PyObject* sets[] = {c->dead, c->ended, c->replies_ended};
  for (PyObject* ranks : sets) {
    if (known) break;
    known = PySequence_Contains(ranks, rank);
    if (known < 0) return nullptr;
  }
  if (known) {  // (Python's: it says why not, or goes on where it may)
    *inner = PyObject_Vectorcall(c->full, self->arg, 6, nullptr);
    return nullptr;
  }
  PyObject *call_id = PyIter_Next(c->ids), *future = nullptr, *entry = nullptr,
           *request = nullptr, *done = nullptr, *answer = nullptr;
  PyObject* out = nullptr;
  int found = -1;
  int wants = call_id == nullptr ? -1 : PyObject_IsTrue(kwargs);
  if (wants < 0) goto end;
  future = PyObject_CallNoArgs(c->create_future);
  if (future == nullptr) goto end;
  entry = PyTuple_Pack(4, rank, future, name, method);
  if (entry == nullptr || PyDict_SetItem(c->calls, call_id, entry) < 0) goto end;
  request = PyList_New(5 + PyTuple_GET_SIZE(args));  // [id, name, method, True, kwargs, *args]
  if (request == nullptr) goto end;
  {
    PyObject* head[] = {call_id, name, method, Py_True, wants ? kwargs : Py_None};
    for (Py_ssize_t i = 0; i < 5; i++) {
      Py_INCREF(head[i]);
      PyList_SET_ITEM(request, i, head[i]);
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
      PyObject* item = PyTuple_GET_ITEM(args, i);
      Py_INCREF(item);
      PyList_SET_ITEM(request, 5 + i, item);
    }
    PyObject* queued = PyDict_GetItemWithError(c->backlog, rank);  // (borrowed)
    int behind = queued == nullptr ? (PyErr_Occurred() ? -1 : 0) : PyObject_IsTrue(queued);
    if (behind < 0) goto end;
    int posted = 0;
    if (!behind) {
      PyObject* post_args[] = {request, rank};
      posted = truth_of(PyObject_Vectorcall(c->post, post_args, 2, nullptr));
      if (posted < 0) goto end;
    }
    if (!posted) {
      PyObject* queue_args[] = {rank, c->requests, request};
      PyObject* queued_now = PyObject_Vectorcall(c->queue, queue_args, 3, nullptr);
      if (queued_now == nullptr) goto end;
      Py_DECREF(queued_now);
    }
  }
  done = PyObject_GetAttr(future, str_done);
  if (done == nullptr) goto end;
  if (c->look != Py_None) {
    PyObject* look_args[] = {done, Py_None};
    PyObject* looked = PyObject_Vectorcall(c->look, look_args, 2, nullptr);
    if (looked == nullptr) goto end;
    long value = PyLong_AsLong(looked);
    Py_DECREF(looked);
    if (value == -1 && PyErr_Occurred()) goto end;
    found = value > 0 ? 1 : value == 0 ? 0 : -1;
  }
  if (found < 0) {
    PyObject* expected = PyObject_CallNoArgs(c->router_expect);
    if (expected == nullptr) goto end;
    Py_DECREF(expected);
    found = truth_of(PyObject_CallOneArg(c->hurry, done));
    if (found < 0) goto end;
  } else if (found == 0) {  // (looked, with what it issued sent: now the poller watches)
    PyObject* expected = PyObject_CallNoArgs(c->link_expect);
    if (expected == nullptr) goto end;
    Py_DECREF(expected);
  }
  if (!found) {
    PyObject* finish_args[] = {rank, name, method, call_id, future, timeout};
    *inner = PyObject_Vectorcall(c->finish, finish_args, 6, nullptr);
    goto end;
  }
  if (PyDict_DelItem(c->calls, call_id) < 0) goto end;  // an answer within microseconds
  answer = PyObject_CallMethodNoArgs(future, str_result);
  if (answer == nullptr) goto end;
  if (PyTuple_CheckExact(answer) && PyTuple_GET_SIZE(answer) == 2 &&
      PyTuple_GET_ITEM(answer, 0) == Py_True) {
    out = PyTuple_GET_ITEM(answer, 1);
    Py_INCREF(out);
  } else {  // (raised, as ``_call`` raises it)
    PyObject* result_args[] = {rank, name, method, PyTuple_GET_ITEM(answer, 0),
                               PyTuple_GET_ITEM(answer, 1)};
    out = PyTuple_CheckExact(answer) && PyTuple_GET_SIZE(answer) == 2
          ? PyObject_Vectorcall(c->result, result_args, 5, nullptr) : nullptr;
    if (out == nullptr && !PyErr_Occurred())
      PyErr_SetString(PyExc_RuntimeError, "an actor call's answer is not (ok, result)");
  }
end:
  Py_XDECREF(call_id);
  Py_XDECREF(future);
  Py_XDECREF(entry);
  Py_XDECREF(request);
  Py_XDECREF(done);
  Py_XDECREF(answer);
  if (out == nullptr && *inner == nullptr && !PyErr_Occurred())
    PyErr_SetString(PyExc_RuntimeError, "an actor call failed without an error");
  return out;
}

// call(rank, name, method, args, kwargs, timeout) -> Step: the coroutine of one call.
PyObject* caller_call(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 6, "call(rank, name, method, args, kwargs, timeout)")) return nullptr;
  return make_step(o, call_first, args, nargs);
}

constexpr int CALLER_REFS = 17;

PyObject** caller_refs(CallerObject* self) { return &self->dead; }  // (its 17, in order)

PyObject* caller_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if ((kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) || !PyTuple_Check(args) ||
      PyTuple_GET_SIZE(args) != CALLER_REFS) {
    PyErr_SetString(PyExc_TypeError, "Caller(...) takes its 17 arguments by position");
    return nullptr;
  }
  auto* self = reinterpret_cast<CallerObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  for (int i = 0; i < CALLER_REFS; i++) {
    PyObject* ref = PyTuple_GET_ITEM(args, i);
    Py_INCREF(ref);
    caller_refs(self)[i] = ref;
  }
  if (!PyDict_Check(self->calls) || !PyDict_Check(self->backlog)) {
    Py_DECREF(self);
    PyErr_SetString(PyExc_TypeError, "Caller: calls and backlog must be dicts");
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(self);
}

int caller_traverse(PyObject* o, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(o));
  for (int i = 0; i < CALLER_REFS; i++) Py_VISIT(caller_refs(reinterpret_cast<CallerObject*>(o))[i]);
  return 0;
}

int caller_clear(PyObject* o) {
  for (int i = 0; i < CALLER_REFS; i++) Py_CLEAR(caller_refs(reinterpret_cast<CallerObject*>(o))[i]);
  return 0;
}

PyMethodDef caller_methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(caller_call)),
     METH_FASTCALL, "call(rank, name, method, args, kwargs, timeout) -> a coroutine: one call"},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot caller_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(caller_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(gc_dealloc<caller_clear>)},
    {Py_tp_traverse, reinterpret_cast<void*>(caller_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(caller_clear)},
    {Py_tp_methods, caller_methods},
    {Py_tp_doc, const_cast<char*>("Caller(...): actor calls, compiled where answered at once")},
    {0, nullptr}};

PyType_Spec caller_spec = {"asyncomm_small.Caller", sizeof(CallerObject), 0,
                           Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, caller_slots};

PyObject* receiver_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "Receiver(...) takes no keyword arguments");
    return nullptr;
  }
  PyObject *frames, *taken, *message_type, *probe, *look, *took, *receive, *wait, *timeout;
  long long batch_less_one, size;
  int small;
  if (!PyArg_ParseTuple(args, "OO!O!OOOOOO!LLp", &frames, &PyDict_Type, &taken, &PyType_Type,
                        &message_type, &probe, &look, &took, &receive, &wait, &PyFloat_Type,
                        &timeout, &batch_less_one, &size, &small))
    return nullptr;
  if (!PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(message_type), &PyTuple_Type)) {
    PyErr_SetString(PyExc_TypeError, "Receiver: message_type must be a tuple type");
    return nullptr;
  }
  auto* self = reinterpret_cast<ReceiverObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  PyObject* refs[] = {frames, taken, message_type, probe, look, took, receive, wait, timeout};
  PyObject** slots[] = {&self->frames, &self->taken, &self->message_type, &self->probe,
                        &self->look,   &self->took,  &self->receive,      &self->wait,
                        &self->timeout};
  for (size_t i = 0; i < sizeof(refs) / sizeof(refs[0]); i++) {
    Py_INCREF(refs[i]);
    *slots[i] = refs[i];
  }
  self->batch_less_one = batch_less_one;
  self->size = size;
  self->small = static_cast<char>(small);
  return reinterpret_cast<PyObject*>(self);
}

int receiver_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<ReceiverObject*>(o);
  Py_VISIT(Py_TYPE(o));
  PyObject* refs[] = {self->frames, self->taken,   self->message_type,
                      self->probe,  self->look,    self->took,
                      self->receive, self->wait,   self->timeout};
  for (PyObject* r : refs) Py_VISIT(r);
  return 0;
}

int receiver_clear(PyObject* o) {
  auto* self = reinterpret_cast<ReceiverObject*>(o);
  PyObject** refs[] = {&self->frames, &self->taken,   &self->message_type,
                       &self->probe,  &self->look,    &self->took,
                       &self->receive, &self->wait,   &self->timeout};
  for (PyObject** r : refs) Py_CLEAR(*r);
  return 0;
}

PyMethodDef receiver_methods[] = {
    {"receive", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(receiver_receive)),
     METH_FASTCALL, "receive(src, timeout) -> a coroutine: one recv"},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot receiver_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(receiver_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(gc_dealloc<receiver_clear>)},
    {Py_tp_traverse, reinterpret_cast<void*>(receiver_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(receiver_clear)},
    {Py_tp_methods, receiver_methods},
    {Py_tp_doc, const_cast<char*>(
        "Receiver(frames, taken, message_type, probe, look, took, receive, wait, timeout, "
        "batch_less_one, size, small): a channel's recv, compiled where it finds its message")},
    {0, nullptr}};

PyType_Spec receiver_spec = {"asyncomm_small.Receiver", sizeof(ReceiverObject), 0,
                             Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, receiver_slots};

// -- actors' listeners: a request to its actor's inbox, a reply to its call ----------------
//
// ``Host._on_request`` and ``Host._on_reply`` (actors), compiled for the commonest message:
// a small ``Message`` of the expected shape (a request whose actor is served here: its
// inbox's ``items`` appended to and its ``waiter`` woken; a reply whose call is in flight:
// its future's result set to ``(ok, result)``), counted for credit as ``Channel.opened``
// counts it. Any other message goes to the Python listener, uncounted, which refuses what
// is malformed and routes what is not served.

struct ListenerObject {
  PyObject_HEAD
  PyObject *taken, *message_type, *took;  // the mailbox's ``taken``, Message, channel._took
  PyObject *table;   // requests: the actors' inboxes by name; replies: the calls by id
  PyObject *python;  // the Python listener: everything else
  long long batch_less_one;
  int requests;      // whether it routes requests (else settles replies)
};


// A request to its actor's inbox: 1 done, 0 not the commonest, -1 an error.
int route_request(ListenerObject* self, PyObject* entry, PyObject* data) {
  if (PyList_GET_SIZE(data) < 6 || !PyUnicode_CheckExact(PyList_GET_ITEM(data, 1))) return 0;
  PyObject* inbox = PyDict_GetItemWithError(self->table, PyList_GET_ITEM(data, 1));
  if (inbox == nullptr) return PyErr_Occurred() ? -1 : 0;  // (not served: Python's)
  Py_INCREF(inbox);
  PyObject* items = PyObject_GetAttr(inbox, str_items);
  PyObject* waiter = items == nullptr ? nullptr : PyObject_GetAttr(inbox, str_waiter);
  Py_DECREF(inbox);
  int rc = -1;
  if (waiter != nullptr &&
      count_taken(self->taken, PyTuple_GET_ITEM(entry, 0), self->batch_less_one, self->took,
                  entry) == 0) {
    PyObject* appended = PyObject_CallMethodOneArg(items, str_append, entry);
    rc = appended == nullptr ? -1 : 1;
    Py_XDECREF(appended);
    if (rc == 1 && waiter != Py_None) {  // the actor waits: woken (once)
      PyObject* done = PyObject_CallMethodNoArgs(waiter, str_done);
      int over = done == nullptr ? -1 : PyObject_IsTrue(done);
      Py_XDECREF(done);
      if (over < 0) {
        rc = -1;
      } else if (!over) {
        PyObject* set = PyObject_CallMethodOneArg(waiter, str_set_result, Py_None);
        if (set == nullptr) rc = -1;
        Py_XDECREF(set);
      }
    }
  }
  Py_XDECREF(items);
  Py_XDECREF(waiter);
  return rc;
}

// A reply to its call: 1 done, 0 not the commonest, -1 an error.
int settle_reply(ListenerObject* self, PyObject* entry, PyObject* data) {
  if (PyList_GET_SIZE(data) != 3) return 0;
  PyObject* pending = PyDict_GetItemWithError(self->table, PyList_GET_ITEM(data, 0));
  if (pending == nullptr) return PyErr_Occurred() ? -1 : 0;  // (expired, or not ours)
  if (!PyTuple_CheckExact(pending) || PyTuple_GET_SIZE(pending) < 2) return 0;
  PyObject* future = PyTuple_GET_ITEM(pending, 1);
  Py_INCREF(future);
  int rc = -1;
  PyObject* done = PyObject_CallMethodNoArgs(future, str_done);
  int over = done == nullptr ? -1 : PyObject_IsTrue(done);
  Py_XDECREF(done);
  if (over == 0) {
    rc = count_taken(self->taken, PyTuple_GET_ITEM(entry, 0), self->batch_less_one,
                     self->took, entry) == 0 ? 1 : -1;
    PyObject* result = rc < 0 ? nullptr
                       : PyTuple_Pack(2, PyList_GET_ITEM(data, 1), PyList_GET_ITEM(data, 2));
    PyObject* set = result == nullptr ? nullptr
                    : PyObject_CallMethodOneArg(future, str_set_result, result);
    if (set == nullptr) rc = -1;
    Py_XDECREF(result);
    Py_XDECREF(set);
  } else if (over > 0) {
    rc = 0;  // (settled already: Python's, which counts and drops it)
  }
  Py_DECREF(future);
  return rc;
}

PyObject* listener_listen(PyObject* o, PyObject* entry) {
  auto* self = reinterpret_cast<ListenerObject*>(o);
  int rc = 0;
  if (Py_TYPE(entry) == reinterpret_cast<PyTypeObject*>(self->message_type) &&
      PyTuple_GET_SIZE(entry) == 3 && PyList_CheckExact(PyTuple_GET_ITEM(entry, 2))) {
    PyObject* data = PyTuple_GET_ITEM(entry, 2);
    rc = self->requests ? route_request(self, entry, data) : settle_reply(self, entry, data);
  }
  if (rc < 0) return nullptr;
  if (rc > 0) Py_RETURN_NONE;
  return PyObject_CallOneArg(self->python, entry);
}

PyObject* listener_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "Listener(...) takes no keyword arguments");
    return nullptr;
  }
  PyObject *taken, *message_type, *took, *table, *python;
  long long batch_less_one;
  int requests;
  if (!PyArg_ParseTuple(args, "O!O!OO!OLp", &PyDict_Type, &taken, &PyType_Type, &message_type,
                        &took, &PyDict_Type, &table, &python, &batch_less_one, &requests))
    return nullptr;
  auto* self = reinterpret_cast<ListenerObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  PyObject* refs[] = {taken, message_type, took, table, python};
  PyObject** slots[] = {&self->taken, &self->message_type, &self->took, &self->table,
                        &self->python};
  for (size_t i = 0; i < sizeof(refs) / sizeof(refs[0]); i++) {
    Py_INCREF(refs[i]);
    *slots[i] = refs[i];
  }
  self->batch_less_one = batch_less_one;
  self->requests = requests;
  return reinterpret_cast<PyObject*>(self);
}

int listener_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<ListenerObject*>(o);
  Py_VISIT(Py_TYPE(o));
  PyObject* refs[] = {self->taken, self->message_type, self->took, self->table, self->python};
  for (PyObject* r : refs) Py_VISIT(r);
  return 0;
}

int listener_clear(PyObject* o) {
  auto* self = reinterpret_cast<ListenerObject*>(o);
  PyObject** refs[] = {&self->taken, &self->message_type, &self->took, &self->table,
                       &self->python};
  for (PyObject** r : refs) Py_CLEAR(*r);
  return 0;
}

PyMethodDef listener_methods[] = {
    {"listen", listener_listen, METH_O, "listen(entry): a mailbox's listener"},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot listener_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(listener_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(gc_dealloc<listener_clear>)},
    {Py_tp_traverse, reinterpret_cast<void*>(listener_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(listener_clear)},
    {Py_tp_methods, listener_methods},
    {Py_tp_doc, const_cast<char*>(
        "Listener(taken, message_type, took, table, python, batch_less_one, requests): an "
        "actors' mailbox listener, compiled for the commonest message")},
    {0, nullptr}};

PyType_Spec listener_spec = {"asyncomm_small.Listener", sizeof(ListenerObject), 0,
                             Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, listener_slots};

// -- posting: ``Channel.post`` in one call --------------------------------------------------
//
// Actors post every request and reply (``Channel.post``): the window of a rank checked
// before, looked up, then ``Outbox.post``. ``Poster.post`` does that commonest case; a
// rank without a window yet goes to the Python ``post``, a full packet to ``_go_full``,
// a traced channel while recording is refused (as the Python ``post`` refuses it).

struct PosterObject {
  PyObject_HEAD
  PyObject *windows;  // the channel's, by destination (changed in place, never replaced)
  PyObject *post;     // the link's outbox's post
  PyObject *tag, *room, *max_ndim, *limit;  // its arguments, the channel's
  PyObject *probe;    // None, or a traced channel's Probe (its ``recording`` read)
  PyObject *go_full;  // channel._go_full(window, obj, dst) -> bool
  PyObject *python;   // Channel.post, bound: a destination without a window yet
  // ``send``'s Python coroutines, (obj, dst, timeout): encoded and sent (not small, or no
  // credit), to a rank not checked before, and whole (a traced channel)
  PyObject *encoded, *slowly, *whole;
};

enum Posted { POSTED = 1, NOT_SMALL = 0, NO_WINDOW = 2, TRACED = 3 };

// ``obj`` posted to ``dst`` where it may be (POSTED); else why not: NOT_SMALL (not small,
// or no credit: ``send`` encodes and waits), NO_WINDOW (a rank not checked before), TRACED
// (a traced channel while recording); -1 an error raised.
int poster_try(PosterObject* self, PyObject* obj, PyObject* dst) {
  PyObject* window = PyLong_CheckExact(dst) ? PyDict_GetItemWithError(self->windows, dst)
                                            : nullptr;  // (borrowed)
  if (window == nullptr) return PyErr_Occurred() ? -1 : NO_WINDOW;
  if (self->probe != Py_None) {
    PyObject* recording = PyObject_GetAttr(self->probe, str_recording);
    if (recording == nullptr) return -1;
    bool traced = recording != Py_None;
    Py_DECREF(recording);
    if (traced) return TRACED;
  }
  Py_INCREF(window);  // (held while the outbox runs Python: its flush may change the dict)
  PyObject* call[] = {window, dst, self->tag, obj, self->room, self->max_ndim, self->limit};
  PyObject* answer = PyObject_Vectorcall(self->post, call, 7, nullptr);
  long got = answer == nullptr ? -1 : PyLong_AsLong(answer);
  Py_XDECREF(answer);
  int posted = -1;
  if (answer == nullptr || (got == -1 && PyErr_Occurred())) {
    posted = -1;
  } else if (got >= 0) {
    posted = POSTED;
  } else if (got == -1) {  // the packet full: it goes, and this message in the next
    PyObject* full[] = {window, obj, dst};
    int went = truth_of(PyObject_Vectorcall(self->go_full, full, 3, nullptr));
    posted = went < 0 ? -1 : went ? POSTED : NOT_SMALL;
  } else {
    posted = NOT_SMALL;
  }
  Py_DECREF(window);
  return posted;
}

PyObject* poster_post(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "post(obj, dst)")) return nullptr;
  auto* self = reinterpret_cast<PosterObject*>(o);
  int posted = poster_try(self, args[0], args[1]);
  if (posted < 0) return nullptr;
  if (posted == NO_WINDOW) return PyObject_Vectorcall(self->python, args, 2, nullptr);
  return PyBool_FromLong(posted == POSTED);
}

// What a fresh send's Step does when first sent to: None (posted), or nullptr with
// ``*inner`` the Python coroutine it hands over to (``Channel.send``'s other cases).
PyObject* send_first(StepObject* step, PyObject** inner) {
  auto* self = reinterpret_cast<PosterObject*>(step->owner);
  *inner = nullptr;
  int posted = poster_try(self, step->arg[0], step->arg[1]);
  if (posted < 0) return nullptr;
  if (posted == POSTED) Py_RETURN_NONE;
  PyObject* rest = posted == NOT_SMALL ? self->encoded : posted == NO_WINDOW ? self->slowly
                   : self->whole;
  *inner = PyObject_Vectorcall(rest, step->arg, 3, nullptr);
  return nullptr;
}

// send(obj, dst, timeout) -> Step: the coroutine of one send.
PyObject* poster_send(PyObject* o, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "send(obj, dst, timeout)")) return nullptr;
  return make_step(o, send_first, args, nargs);
}

PyObject* poster_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "Poster(...) takes no keyword arguments");
    return nullptr;
  }
  PyObject *windows, *post, *tag, *room, *max_ndim, *limit, *probe, *go_full, *python,
      *encoded, *slowly, *whole;
  if (!PyArg_ParseTuple(args, "O!OOOOOOOOOOO", &PyDict_Type, &windows, &post, &tag, &room,
                        &max_ndim, &limit, &probe, &go_full, &python, &encoded, &slowly,
                        &whole))
    return nullptr;
  auto* self = reinterpret_cast<PosterObject*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  PyObject* refs[] = {windows, post,  tag,     room,    max_ndim, limit,
                      probe,   go_full, python, encoded, slowly,  whole};
  PyObject** slots[] = {&self->windows, &self->post,    &self->tag,     &self->room,
                        &self->max_ndim, &self->limit,  &self->probe,   &self->go_full,
                        &self->python,  &self->encoded, &self->slowly,  &self->whole};
  for (size_t i = 0; i < sizeof(refs) / sizeof(refs[0]); i++) {
    Py_INCREF(refs[i]);
    *slots[i] = refs[i];
  }
  return reinterpret_cast<PyObject*>(self);
}

int poster_traverse(PyObject* o, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<PosterObject*>(o);
  Py_VISIT(Py_TYPE(o));
  PyObject* refs[] = {self->windows, self->post,    self->tag,    self->room,
                      self->max_ndim, self->limit,  self->probe,  self->go_full,
                      self->python,  self->encoded, self->slowly, self->whole};
  for (PyObject* r : refs) Py_VISIT(r);
  return 0;
}

int poster_clear(PyObject* o) {
  auto* self = reinterpret_cast<PosterObject*>(o);
  PyObject** refs[] = {&self->windows, &self->post,    &self->tag,    &self->room,
                       &self->max_ndim, &self->limit,  &self->probe,  &self->go_full,
                       &self->python,  &self->encoded, &self->slowly, &self->whole};
  for (PyObject** r : refs) Py_CLEAR(*r);
  return 0;
}

PyMethodDef poster_methods[] = {
    {"post", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(poster_post)),
     METH_FASTCALL, "post(obj, dst) -> bool: Channel.post"},
    {"send", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(poster_send)),
     METH_FASTCALL, "send(obj, dst, timeout) -> a coroutine: one Channel.send"},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot poster_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(poster_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(gc_dealloc<poster_clear>)},
    {Py_tp_traverse, reinterpret_cast<void*>(poster_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(poster_clear)},
    {Py_tp_methods, poster_methods},
    {Py_tp_doc, const_cast<char*>(
        "Poster(windows, post, tag, room, max_ndim, limit, probe, go_full, python, encoded, "
        "slowly, whole): a channel's post and send, compiled for a small message to a "
        "destination with a window")},
    {0, nullptr}};

PyType_Spec poster_spec = {"asyncomm_small.Poster", sizeof(PosterObject), 0,
                           Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, poster_slots};

PyMethodDef methods[] = {
    {"setup", setup, METH_O, "setup(table): the dtype codes, as (code, empty tensor)"},
    {"encode", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(encode)),
     METH_FASTCALL, "encode(tensor, room, max_ndim) -> bytes | None"},
    {"keep", keep, METH_O, "keep(descriptor): a tensor descriptor, checked"},
    {"span", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(span)), METH_FASTCALL,
     "span(tensor, table) -> (address, bytes, table[dtype]) | None"},
    {"forget", forget, METH_NOARGS, "forget(): no descriptor kept"},
    {"inline", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(inline_)),
     METH_FASTCALL, "inline(twin, max_ndim, code, payload) -> object"},
    {"unpack_packet", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(unpack_packet)),
     METH_FASTCALL, "unpack_packet(data, max_ndim) -> list | None"},
    {"unpack_message",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(unpack_message)),
     METH_FASTCALL, "unpack_message(buffer, count, max_ndim, src, wrap) -> list | None"},
    {nullptr, nullptr, 0, nullptr}};

#define ASYNCOMM_STR2(name) #name
#define ASYNCOMM_STR(name) ASYNCOMM_STR2(name)

PyModuleDef module = {PyModuleDef_HEAD_INIT, ASYNCOMM_STR(TORCH_EXTENSION_NAME),
                      "The tensor work of small frames, compiled", -1, methods};

}  // namespace

#define ASYNCOMM_INIT2(name) PyInit_##name
#define ASYNCOMM_INIT(name) ASYNCOMM_INIT2(name)

PyMODINIT_FUNC ASYNCOMM_INIT(TORCH_EXTENSION_NAME)() {
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  one = PyLong_FromLong(1);  // (small ints are immortal in effect: never freed)
  if (PyModule_AddObject(m, "FAIR_S", PyFloat_FromDouble(FAIR_S)) < 0) {  // (checked by tests)
    Py_DECREF(m);
    return nullptr;
  }
  PyObject* lane = PyType_FromSpec(&lane_spec);
  if (lane == nullptr || PyModule_AddObject(m, "Lane", lane) < 0) {
    Py_XDECREF(lane);
    Py_DECREF(m);
    return nullptr;
  }
  PyObject* outbox = PyType_FromSpec(&outbox_spec);
  if (outbox == nullptr || PyModule_AddObject(m, "Outbox", outbox) < 0) {
    Py_XDECREF(outbox);
    Py_DECREF(m);
    return nullptr;
  }
  str_popleft = PyUnicode_InternFromString("popleft");
  str_recording = PyUnicode_InternFromString("recording");
  str_throw = PyUnicode_InternFromString("throw");
  str_close = PyUnicode_InternFromString("close");
  str_items = PyUnicode_InternFromString("items");
  str_waiter = PyUnicode_InternFromString("waiter");
  str_append = PyUnicode_InternFromString("append");
  str_done = PyUnicode_InternFromString("done");
  str_set_result = PyUnicode_InternFromString("set_result");
  str_result = PyUnicode_InternFromString("result");
  PyObject* caller = PyType_FromSpec(&caller_spec);
  if (str_result == nullptr || caller == nullptr || PyModule_AddObject(m, "Caller", caller) < 0) {
    Py_XDECREF(caller);
    Py_DECREF(m);
    return nullptr;
  }
  PyObject* poster = PyType_FromSpec(&poster_spec);
  if (poster == nullptr || PyModule_AddObject(m, "Poster", poster) < 0) {
    Py_XDECREF(poster);
    Py_DECREF(m);
    return nullptr;
  }
  PyObject* listener = PyType_FromSpec(&listener_spec);
  if (str_items == nullptr || str_waiter == nullptr || str_append == nullptr ||
      str_done == nullptr || str_set_result == nullptr || listener == nullptr ||
      PyModule_AddObject(m, "Listener", listener) < 0) {
    Py_XDECREF(listener);
    Py_DECREF(m);
    return nullptr;
  }
  step_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&step_spec));
  PyObject* receiver = PyType_FromSpec(&receiver_spec);
  if (str_popleft == nullptr || str_recording == nullptr || str_throw == nullptr ||
      str_close == nullptr || step_type == nullptr || receiver == nullptr ||
      PyModule_AddObject(m, "Receiver", receiver) < 0) {
    Py_XDECREF(receiver);
    Py_DECREF(m);
    return nullptr;
  }
  Py_INCREF(step_type);  // (the module's too: its instances are made by Receiver)
  if (PyModule_AddObject(m, "Step", reinterpret_cast<PyObject*>(step_type)) < 0) {
    Py_DECREF(step_type);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
