package main

/*
#include <stdint.h>

// In sigint.c.
int ft_sigint_install(int wr) __attribute__((visibility("hidden")));
int ft_sigint_installed(void) __attribute__((visibility("hidden")));
*/
import "C"

import (
	"fmt"
	"os"
	"syscall"
)

// sigPipe is the write end the C handler writes to; the goroutine started
// with it reads the other end for the life of the process.
var sigPipe struct {
	w  *os.File
	fd int
}

func startSignalReader() error {
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	fd := int(w.Fd())
	if err := syscall.SetNonblock(fd, true); err != nil { // a full pipe must not block the handler
		return err
	}
	sigPipe.w, sigPipe.fd = w, fd
	go func() { // runs until the process exits
		b := make([]byte, 64)
		for {
			if _, err := r.Read(b); err != nil {
				return
			}
			interruptAll()
		}
	}()
	return nil
}

// ftcomm_interrupt_install chains the SIGINT handler (see the package
// doc): Ctrl-C then ends every blocking call at once before the previous
// handler runs. It returns 1 if it installed the chain, 0 if it was in
// place already, or an error status.
//
//export ftcomm_interrupt_install
func ftcomm_interrupt_install() C.int32_t {
	var res C.int32_t
	st := guard(func() error {
		abi.sigOnce.Do(func() { abi.sigErr = startSignalReader() })
		if abi.sigErr != nil {
			return fmt.Errorf("ftcomm: signal pipe: %w", abi.sigErr)
		}
		switch r := C.ft_sigint_install(C.int(sigPipe.fd)); r {
		case 1, 0:
			res = C.int32_t(r)
			return nil
		}
		return fmt.Errorf("ftcomm: sigaction(SIGINT) failed")
	})
	if st != statusOK {
		return st
	}
	return res
}

// ftcomm_interrupt_installed reports whether the chain is in place now (1)
// or not (0): Python code that set its own SIGINT handler removed it.
//
//export ftcomm_interrupt_installed
func ftcomm_interrupt_installed() C.int32_t { return C.int32_t(C.ft_sigint_installed()) }
