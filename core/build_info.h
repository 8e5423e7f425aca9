// What this binary is: version, git commit, compiled-in backends.
#pragma once

namespace tandem {

const char* version_string();
const char* git_commit();

}  // namespace tandem
