// hylo's CUDA libraries take one structure of operands a call (`int entry(const Call*, void* stream)`), mirrored
// in Python by ctypes structures. `<entry>_call_layout` reports where each leaf field of `Call` lies, in
// declaration order, so the loader (`cuda_build.bind_call`) refuses a library whose structure and mirror differ
// in any field's place or width (a size alone misses two fields swapped).
#pragma once

#include <cstddef>

// {byte offset, byte size} of `field` (a member designator, nested fields with '.') of `Call`.
#define HYLO_FIELD(Call, field) \
    { static_cast<long long>(offsetof(Call, field)), static_cast<long long>(sizeof(static_cast<Call*>(nullptr)->field)) }

namespace hylo_abi {

// Copies up to `capacity` of the N {offset, size} pairs into `out` (2 per field); returns N.
template <int N>
inline int write_layout(const long long (&fields)[N][2], long long* out, int capacity) {
    for (int i = 0; i < N && i < capacity; ++i) {
        out[2 * i] = fields[i][0];
        out[2 * i + 1] = fields[i][1];
    }
    return N;
}

}  // namespace hylo_abi
