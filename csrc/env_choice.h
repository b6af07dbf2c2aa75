// The A/B switches read from the environment at every launch (MEGATRON_DUALKV_*): a variable's
// value as one of its allowed codes. No torch headers (the .cu files include it).
#pragma once
#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace mdkv {

struct EnvValue {
  const char* text;
  int code;
};

// The code of variable `var`'s value among `values`; unset or empty reads as the first value; -1
// for any other value (the ops name the variable and its allowed values before a launch)
inline int env_choice(const char* var, std::initializer_list<EnvValue> values) {
  const char* m = std::getenv(var);
  if (m == nullptr || m[0] == '\0') return values.begin()->code;
  for (const EnvValue& v : values)
    if (std::strcmp(m, v.text) == 0) return v.code;
  return -1;
}

}  // namespace mdkv
