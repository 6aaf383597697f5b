// The c10d classes that the transport's headers name by reference only, declared without
// c10d's own headers (which cost every includer their compile time).
#pragma once

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d
