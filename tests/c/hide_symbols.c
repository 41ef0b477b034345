/*
 * hide_symbols.c -- for a test build of the preload shim compiled with -Ddlsym=fitcache_test_dlsym
 * (tests/test_preload.py): the shim's dlsym, which finds no function named in the
 * comma-separated FITCACHE_TEST_HIDDEN, as under a C library older than the function.
 */
#undef dlsym
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

void *fitcache_test_dlsym(void *handle, const char *name) {
	const char *hidden = getenv("FITCACHE_TEST_HIDDEN");
	size_t n = strlen(name);
	for (const char *p = hidden; p && *p;) {
		const char *end = strchr(p, ',');
		size_t len = end ? (size_t)(end - p) : strlen(p);
		if (len == n && memcmp(p, name, n) == 0)
			return NULL;
		p = end ? end + 1 : p + len;
	}
	// RTLD_NEXT is relative to the caller: this file is in the shim's library, as the shim is.
	return dlsym(handle, name);
}
