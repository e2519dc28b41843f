//go:build !amd64

package reduce

var haveAVX2 = false // lets the shared tests flip it
