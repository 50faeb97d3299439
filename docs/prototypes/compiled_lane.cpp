// The compiled half of compiled_lane.py: a channel lane's per-message duties in C++.
//
// Not part of asyncomm; built by compiled_lane.py (torch's C++ extension loader). One lane
// per process, on one MPI tag: each message a record (a fixed binary head: kind, dtype
// code, tag, sequence number, bytes; then its bytes), the records issued to a peer
// travelling together in one MPI message of up to 16, sent when a receiver waits (or the
// 16th is issued). A record holds a CPU tensor's bytes, or an object packed with msgpack
// (msgpack's own C code, called here; its bytes checked for extensions, as asyncomm
// does). What it does per message, as lean_tensor.py and lean_semantics.py do in Python:
// the destination and the tensor checked (CPU, strided, contiguous, no neg or conj bit,
// a known dtype), a sequence number per (channel, destination) sent and checked per
// (source, channel), a window of 64 messages per destination with credit returned every
// 16 taken, a fresh tensor or object per message received; messages found by one
// persistent any-source receive kept started.

#include <torch/extension.h>
#include <mpi.h>

#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <stdexcept>
#include <utility>
#include <vector>

namespace {

#pragma pack(push, 1)
struct Head {
  uint8_t kind;  // 1: a message, 2: credit
  uint8_t code;  // dtype
  uint64_t tag;
  uint64_t seq;  // a message's number; credit: messages taken
  uint32_t nbytes;
};
#pragma pack(pop)

constexpr uint8_t MESSAGE = 1, CREDIT = 2, OBJECT = 3;
constexpr int WINDOW = 64, BATCH = 16, RECORDS = 16;
constexpr size_t MOST = 16 << 10, SLOT = 64 << 10;  // a record's bytes, a packet's

int code_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 1;
    case at::kDouble: return 2;
    case at::kLong: return 3;
    default: return 0;
  }
}

at::ScalarType dtype_of(int code) {
  return code == 1 ? at::kFloat : code == 2 ? at::kDouble : at::kLong;
}

struct Window { uint64_t seq = 0; int out = 0; };
struct Source { uint64_t due = 0; int taken = 0; };
struct Packet { std::vector<char> bytes; int records = 0; };

bool has_extension(const char* p, size_t n) {  // a byte that may start a msgpack extension
  for (size_t i = 0; i < n; i++) {
    unsigned char b = p[i];
    if ((b >= 0xc7 && b <= 0xc9) || (b >= 0xd4 && b <= 0xd8)) return true;
  }
  return false;
}

struct Lane {
  MPI_Comm comm;
  int tag, size;
  std::vector<char> slot = std::vector<char>(SLOT);
  MPI_Request posted;
  std::map<int, Packet> packets;  // records to send, per destination
  py::object pack, unpackb;
  std::vector<std::pair<std::vector<char>, MPI_Request>> sending;  // not done at once
  std::map<std::pair<uint64_t, int>, Window> windows;  // (channel, destination)
  std::map<std::pair<uint64_t, int>, Source> sources;  // (channel, source)

  Lane(int64_t handle, int tag_, py::object pack_, py::object unpackb_)
      : comm(MPI_Comm_f2c(handle)), tag(tag_), pack(pack_), unpackb(unpackb_) {
    MPI_Comm_size(comm, &size);
    MPI_Recv_init(slot.data(), slot.size(), MPI_BYTE, MPI_ANY_SOURCE, tag, comm, &posted);
    MPI_Start(&posted);
  }

  void queue(const Head& head, const void* data, int dst) {
    Packet& packet = packets[dst];
    size_t at = packet.bytes.size();
    packet.bytes.resize(at + sizeof(Head) + head.nbytes);
    std::memcpy(packet.bytes.data() + at, &head, sizeof(Head));
    if (head.nbytes) std::memcpy(packet.bytes.data() + at + sizeof(Head), data, head.nbytes);
    if (++packet.records >= RECORDS || packet.bytes.size() > SLOT - sizeof(Head) - MOST)
      send_packet(dst, packet);
  }

  void send_packet(int dst, Packet& packet) {
    MPI_Request request;
    MPI_Isend(packet.bytes.data(), packet.bytes.size(), MPI_BYTE, dst, tag, comm, &request);
    int done = 0;
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done) {
      packet.bytes.clear();
    } else {  // (kept until done)
      sending.emplace_back(std::move(packet.bytes), request);
      packet.bytes = std::vector<char>();
    }
    packet.records = 0;
  }

  Window& window(int64_t dst, uint64_t channel) {
    if (dst < 0 || dst >= size) throw std::invalid_argument("dst is not a rank");
    Window& w = windows[{channel, static_cast<int>(dst)}];
    if (w.out >= WINDOW) throw std::runtime_error("out of credit (a real channel waits)");
    return w;
  }

  // Queue ``t`` for ``dst`` on channel ``channel``; it leaves with ``flush``.
  void send(const at::Tensor& t, int64_t dst, uint64_t channel) {
    int code = code_of(t.scalar_type());
    if (!code || !t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous() ||
        t.is_neg() || t.is_conj() || t.nbytes() > MOST)
      throw std::invalid_argument("not a small plain CPU tensor, laid out as it lies");
    Window& w = window(dst, channel);
    w.out++;
    Head head{MESSAGE, static_cast<uint8_t>(code), channel, w.seq++,
              static_cast<uint32_t>(t.nbytes())};
    queue(head, t.data_ptr(), dst);
  }

  // Queue ``obj`` (packed with msgpack) for ``dst`` on channel ``channel``.
  void send_object(py::handle obj, int64_t dst, uint64_t channel) {
    py::bytes body = pack(obj);
    char* data;
    Py_ssize_t n;
    PyBytes_AsStringAndSize(body.ptr(), &data, &n);
    if (n > MOST || has_extension(data, n))
      throw std::invalid_argument("too large, or an extension (asyncomm lowers it instead)");
    Window& w = window(dst, channel);
    w.out++;
    queue(Head{OBJECT, 0, channel, w.seq++, static_cast<uint32_t>(n)}, data, dst);
  }

  void flush() {
    for (auto& [dst, packet] : packets)
      if (packet.records) send_packet(dst, packet);
    for (size_t i = 0; i < sending.size();) {
      int done = 0;
      MPI_Test(&sending[i].second, &done, MPI_STATUS_IGNORE);
      if (done) { sending[i] = std::move(sending.back()); sending.pop_back(); } else { i++; }
    }
  }

  // The messages of the next packet there, as [(source, channel, data)], or None.
  py::object pump() {
    while (true) {
      int done = 0;
      MPI_Status status;
      MPI_Test(&posted, &done, &status);
      if (!done) return py::none();
      int count = 0;
      MPI_Get_count(&status, MPI_BYTE, &count);
      int src = status.MPI_SOURCE;
      // Records first (a tensor's made at once), the objects' bodies gathered as one
      // msgpack array and unpacked in one call, then paired with their records.
      std::vector<std::tuple<int, uint64_t, py::object>> records;
      std::string bodies = std::string("\xdc\0\0", 3);
      uint16_t objects = 0;
      for (size_t at = 0; at < static_cast<size_t>(count);) {
        Head head;
        if (count - at < sizeof(Head)) throw std::runtime_error("a short record");
        std::memcpy(&head, slot.data() + at, sizeof(Head));
        const char* body = slot.data() + at + sizeof(Head);
        if (head.nbytes > count - at - sizeof(Head)) throw std::runtime_error("a torn record");
        at += sizeof(Head) + head.nbytes;
        if (head.kind == CREDIT) {
          windows[{head.tag, src}].out -= static_cast<int>(head.seq);
          continue;
        }
        Source& from = sources[{head.tag, src}];
        if (head.seq != from.due) throw std::runtime_error("a message out of sequence");
        from.due++;
        if (head.kind == OBJECT) {
          bodies.append(body, head.nbytes);
          objects++;
          records.emplace_back(src, head.tag, py::none());
          continue;
        }
        if (head.kind != MESSAGE || !head.code || head.code > 3)
          throw std::runtime_error("a malformed message");
        at::ScalarType dtype = dtype_of(head.code);
        if (head.nbytes % at::elementSize(dtype)) throw std::runtime_error("a torn tensor");
        at::Tensor t = at::empty({static_cast<int64_t>(head.nbytes / at::elementSize(dtype))},
                                 at::TensorOptions().dtype(dtype));
        std::memcpy(t.data_ptr(), body, head.nbytes);
        records.emplace_back(src, head.tag, py::cast(t));
      }
      py::list out;
      if (objects) {
        bodies[1] = static_cast<char>(objects >> 8);
        bodies[2] = static_cast<char>(objects & 0xff);
        py::list decoded = unpackb(py::memoryview::from_memory(bodies.data(),
                                                               static_cast<Py_ssize_t>(bodies.size())));
        size_t i = 0;
        for (auto& [from, channel, data] : records)
          out.append(py::make_tuple(from, channel, data.is_none() ? decoded[i++] : data));
      } else {
        for (auto& [from, channel, data] : records) out.append(py::make_tuple(from, channel, data));
      }
      MPI_Start(&posted);
      if (py::len(out)) return std::move(out);
    }
  }

  // The user took a message of ``channel`` from ``src``: credit back every BATCH taken.
  void took(int src, uint64_t channel) {
    Source& from = sources[{channel, src}];
    if (++from.taken >= BATCH) {
      from.taken = 0;
      queue(Head{CREDIT, 0, channel, BATCH, 0}, nullptr, src);
    }
  }

  bool waiting() const {
    for (auto& [dst, packet] : packets)
      if (packet.records) return true;
    return false;
  }

  void close() {
    flush();
    MPI_Cancel(&posted);
    MPI_Wait(&posted, MPI_STATUS_IGNORE);
    MPI_Request_free(&posted);
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Lane>(m, "Lane")
      .def(py::init<int64_t, int, py::object, py::object>())
      .def("send", &Lane::send)
      .def("send_object", &Lane::send_object)
      .def("flush", &Lane::flush)
      .def("pump", &Lane::pump)
      .def("took", &Lane::took)
      .def("waiting", &Lane::waiting)
      .def("close", &Lane::close);
}
