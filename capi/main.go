package main

//go:generate go run gen_nvmlstubs.go

// main is required by -buildmode=c-shared and never runs.
func main() {}
