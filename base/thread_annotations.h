// Clang's thread-safety annotations (-Wthread-safety): a member says which
// mutex guards it and a function says which mutex it needs held, and clang
// checks every access at compile time, where a "guarded by" comment is only
// hoped for. Other compilers see empty macros.
// https://clang.llvm.org/docs/ThreadSafetyAnalysis.html
#pragma once

#if defined(__clang__)
#define PSLD_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define PSLD_THREAD_ANNOTATION(x)
#endif

// A class that is a lock (Mutex).
#define CAPABILITY(x) PSLD_THREAD_ANNOTATION(capability(x))
// A class whose constructor acquires and destructor releases (MutexLock).
#define SCOPED_CAPABILITY PSLD_THREAD_ANNOTATION(scoped_lockable)
// A member read or written only with the mutex held.
#define GUARDED_BY(x) PSLD_THREAD_ANNOTATION(guarded_by(x))
// A pointer member whose pointee is read or written only with the mutex held.
#define PT_GUARDED_BY(x) PSLD_THREAD_ANNOTATION(pt_guarded_by(x))
// Lock order: this mutex is taken after (or before) the others.
#define ACQUIRED_AFTER(...) PSLD_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define ACQUIRED_BEFORE(...) PSLD_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
// A function called with the mutex held (exclusively, or shared at least).
#define REQUIRES(...) PSLD_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) PSLD_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))
// A function that takes the mutex itself, so the caller must not hold it.
#define EXCLUDES(...) PSLD_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
// A function that acquires (releases) the mutex and returns with it held (released).
#define ACQUIRE(...) PSLD_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) PSLD_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define RELEASE(...) PSLD_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) PSLD_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
#define RELEASE_GENERIC(...) PSLD_THREAD_ANNOTATION(release_generic_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) PSLD_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
// A function that checks at run time that the mutex is held; afterwards the
// analysis takes it as held.
#define ASSERT_CAPABILITY(x) PSLD_THREAD_ANNOTATION(assert_capability(x))
// A function that returns a reference to the given mutex.
#define RETURN_CAPABILITY(x) PSLD_THREAD_ANNOTATION(lock_returned(x))
// The analysis is off in this function: say why next to it.
#define NO_THREAD_SAFETY_ANALYSIS PSLD_THREAD_ANNOTATION(no_thread_safety_analysis)
