package main

/*
#include <stdint.h>
*/
import "C"

import "unsafe"

//export goPrefetch
func goPrefetch(handle C.int64_t, count C.int, paths **C.char, thisEpoch C.int) (rc C.int) {
	defer guard(&rc)
	c, err := lookupClient(handle)
	if err != nil {
		return fail(err)
	}
	pathv := unsafe.Slice(paths, int(count))
	list := make([]string, len(pathv))
	for i, p := range pathv {
		list[i] = C.GoString(p)
	}
	if err := c.PrefetchEpochs(list, int(thisEpoch)); err != nil {
		return fail(err)
	}
	return 0
}
