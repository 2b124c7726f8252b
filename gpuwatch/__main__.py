from gpuwatch.entry import main

main()
